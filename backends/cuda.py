"""CUDA C kernels compiled at run time and launched through the CUDA driver, where Triton's code
generation is the limit (backends/q4_decode.cu: the int4 decode step's gate/up on the tensor cores;
backends/q4_chain.cu: int4's batch-invariant product at one token).

NVRTC, the runtime compiler, is a library that CUDA builds of torch install with them (the
`nvidia-cuda-nvrtc` wheel; torch's own jiterator uses it), so like Triton's JIT this needs no
compiler on the machine. The module loads the library and the driver with ctypes: a kernel is
compiled once per source, constants and GPU (a fraction of a second, then cached on disk under
$MINICPM_CACHE_DIR or ~/.cache/minicpm/nvrtc, keyed by all of those and NVRTC's version), and launched with
`cuLaunchKernelEx` on torch's current stream, optionally as a programmatic dependent of the
previous kernel (PDL, Hopper and later), as the Triton kernels of a decode step are; launches on
a capturing stream go into its CUDA graph. Imported only where such a kernel is built (CUDA)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import tempfile
from pathlib import Path

import torch

from minicpm_cli import trace
from minicpm_cli.errors import BackendError

_PDL = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class KernelError(BackendError):
    """A kernel that NVRTC cannot compile for this GPU, or that the driver cannot load or launch
    (`kernel`: its name); kernels/fallback.py takes its stage's eager path instead."""

    def __init__(self, message: str, kernel: str = ""):
        super().__init__(message)
        self.kernel = kernel


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                ctypes.c_int, ctypes.c_size_t]
    return lib


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """The NVRTC library of torch's CUDA version: by its name (torch has usually loaded it), else
    from the nvidia wheels beside torch."""
    major = str(torch.version.cuda or "").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    lib = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            pass
    if lib is None:
        try:
            import nvidia

            # (a CPU build of torch names no CUDA version: any NVRTC of the wheels, which is how
            # tools/kernel_targets.py compiles the kernels for GPUs it does not have)
            patterns = names if major else ["libnvrtc.so.[0-9]*"]
            found = next((p for root in nvidia.__path__ for name in patterns for p in sorted(Path(root).glob(f"**/lib/{name}"))),
                         None)
            if found:
                for builtins in found.parent.glob("libnvrtc-builtins.so.*"):  # which NVRTC opens by name
                    if ".alt." not in builtins.name:
                        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                lib = ctypes.CDLL(str(found))
        except (ImportError, OSError):
            pass
    if lib is not None:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise KernelError(f"NVRTC (libnvrtc.so.{major}), which the int4 decode kernels are compiled with, was not "
                       "found: it comes with CUDA builds of torch (the nvidia-cuda-nvrtc wheel)")


def _nvrtc_error(lib: ctypes.CDLL, rc: int) -> str:
    return lib.nvrtcGetErrorString(rc).decode()


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...]) -> bytes:
    """CUBIN for sm_`arch` of `source`, or BackendError with NVRTC's log."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None)
    if rc:
        raise KernelError(f"NVRTC could not take {name}: {_nvrtc_error(lib, rc)}", name)
    try:
        opts = [f"--gpu-architecture=sm_{arch}", "--std=c++17", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise KernelError(f"NVRTC could not compile {name} ({_nvrtc_error(lib, rc)}): "
                              f"{log.value.decode(errors='replace').strip()}", name)
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _driver_check(rc: int, what: str) -> None:
    if rc:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise KernelError(f"{what} failed: {msg.value.decode() if msg.value else rc}", what.split()[-1])


class Kernel:
    """A compiled kernel of one device. `kernel(grid, block, *args, pdl=...)` launches it on the
    current stream: tensors pass their data pointers, Python floats as float, ints as int."""

    def __init__(self, cubin: bytes, name: str, device: torch.device):
        self.name, self.device = name, device
        self._module, self._func = ctypes.c_void_p(), ctypes.c_void_p()
        self._occupancy: dict[int, int] = {}
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.cuda.current_stream()  # the device's primary context is current from here on
            _driver_check(_driver().cuModuleLoadData(ctypes.byref(self._module), cubin), f"loading {name}")
            _driver_check(_driver().cuModuleGetFunction(ctypes.byref(self._func), self._module, name.encode()),
                          f"finding {name}")

    def blocks_per_sm(self, block: int) -> int:
        """How many blocks of `block` threads fit on a multiprocessor at once (registers, shared memory;
        asked of the driver once per block size)."""
        if block not in self._occupancy:
            n = ctypes.c_int()
            _driver_check(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self._func, block, 0),
                          f"occupancy of {self.name}")
            self._occupancy[block] = n.value
        return self._occupancy[block]

    def __call__(self, grid: tuple, block: int, *args, pdl: bool = False) -> None:
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device != self.device:
                    raise ValueError(f"{self.name}: a tensor on {a.device}, kernel on {self.device}")
                values.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, float):
                values.append(ctypes.c_float(a))
            elif isinstance(a, int):
                values.append(ctypes.c_int(a))
            else:
                raise TypeError(f"{self.name}: cannot pass {type(a).__name__}")
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        attr = _Attr(id=_PDL, value=1)
        g = tuple(grid) + (1,) * (3 - len(grid))
        cfg = _Config(grid=(ctypes.c_uint * 3)(*g), block=(ctypes.c_uint * 3)(block, 1, 1), smem=0,
                      stream=torch.cuda.current_stream(self.device).cuda_stream,
                      attrs=ctypes.pointer(attr) if pdl else None, n_attrs=1 if pdl else 0)
        _driver_check(_driver().cuLaunchKernelEx(ctypes.byref(cfg), self._func, params, None), f"launching {self.name}")


def cache_dir() -> Path:
    return Path(os.environ.get("MINICPM_CACHE_DIR") or Path.home() / ".cache" / "minicpm") / "nvrtc"


def _nvrtc_version() -> str:
    lib = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def _cached_compile(source: str, name: str, arch: str, options: tuple[str, ...]) -> bytes:
    """`compile_cubin`, through a disk cache: the key hashes everything the CUBIN depends on. A cache that
    cannot be written (read-only home) only costs the compile."""
    key = hashlib.sha256("\0".join([source, name, arch, *options, _nvrtc_version()]).encode()).hexdigest()
    path = cache_dir() / f"{name}-{key[:32]}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    with trace.span("nvrtc", kernel=name):
        cubin = compile_cubin(source, name, arch, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)  # atomic: a concurrent process reads the old file or the whole new one
    except OSError:
        pass
    return cubin


def cubin(file: str, name: str, arch: str, defines: tuple[tuple[str, int], ...]) -> bytes:
    """Kernel `name` of backends/`file` compiled for sm_`arch` with the -D constants `defines`, through
    the disk cache (also how a first command's compiling helper fills it: kernels/precompile.py)."""
    source = (Path(__file__).parent / file).read_text()
    return _cached_compile(source, name, arch, tuple(f"-D{k}={v}" for k, v in defines))


@functools.cache
def kernel(file: str, name: str, device: torch.device, defines: tuple[tuple[str, int], ...]) -> Kernel:
    """Kernel `name` of backends/`file` compiled for `device` (with its index) with the -D constants
    `defines`."""
    major, minor = torch.cuda.get_device_capability(device)
    return Kernel(cubin(file, name, f"{major}{minor}", defines), name, device)
