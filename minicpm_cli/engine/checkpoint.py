"""Finding and reading a checkpoint in the official MiniCPM-o 2.6 layout.

`resolve(model)` turns a local directory or a Hugging Face repo id into a local directory, downloading
from the hub only what the speech path needs (config, tokenizers, assets, and the safetensors shards
that hold `llm.*` / `tts.*`). `Checkpoint` reads tensors by name from `model.safetensors` or from
shards + `model.safetensors.index.json`; tensors of other modules (vision, audio encoder) are never
read. Every failure is a `ModelNotFound` or `CheckpointError` naming the file or tensor.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from ..errors import CheckpointError, ModelNotFound
from .tensorio import Entry, read_header, read_tensors

DEFAULT_MODEL = "openbmb/MiniCPM-o-2_6"
SPEECH_PREFIXES = ("llm.", "tts.")
SMALL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "assets/Vocos.pt",
    "assets/chattts_tokenizer/tokenizer.json",
    "assets/chattts_tokenizer/tokenizer_config.json",
    "assets/chattts_tokenizer/special_tokens_map.json",
    "assets/chattts_tokenizer/vocab.txt",
)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(model: str, prefixes: Iterable[str] = SPEECH_PREFIXES) -> Path:
    """A local checkpoint directory for `model` (a path, or a hub repo id `owner/name`)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"model path is not a directory: {model}")
        return path
    if not _REPO_ID.match(model) or model.startswith((".", "/", "~")):
        raise ModelNotFound(f"model directory not found: {model}")
    return _download(model, tuple(prefixes))


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for the local cache alone."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a connection to the hub's endpoint opens within `timeout` seconds. Without a network
    the hub's client retries each file for tens of seconds before it gives up; this answers in a few.
    Behind a proxy (HTTPS_PROXY, ALL_PROXY) only the proxy can tell: taken as reachable."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    from huggingface_hub import constants

    url = urllib.parse.urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def connect() -> None:  # (in a thread: a name lookup takes no timeout of its own)
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(result and result[0])


def hub_file(repo: str, name: str, required: bool = True, local_only: bool = False) -> Path | None:
    """One file of a hub repo, from the standard cache or downloaded (with a progress bar); with
    `local_only`, from the cache alone."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import logging as hf_logging

    # Its retry warnings would add lines to stderr; a failure ends in one message of ours instead.
    hf_logging.set_verbosity_error()
    offline = hub_offline()
    try:
        return Path(hf_hub_download(repo, name, local_files_only=local_only))
    except LocalEntryNotFoundError:  # (a subclass of EntryNotFoundError: test it first)
        if local_only and not offline:
            from huggingface_hub import constants

            raise ModelNotFound(f"cannot download {repo}: the Hugging Face hub ({constants.ENDPOINT}) cannot be "
                                "reached and the model is not in the local cache; give --model DIR for a local "
                                "checkpoint") from None
        if offline:
            raise ModelNotFound(f"{repo} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set") from None
        raise ModelNotFound(f"cannot download {repo}: the Hugging Face hub is unreachable and the model is not cached") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"no such model repository on the hub: {repo}") from None
    except EntryNotFoundError:
        if required:
            raise ModelNotFound(f"{repo} has no file {name}") from None
        return None
    except OSError as e:
        raise ModelNotFound(f"cannot download {repo}/{name}: {e}") from None
    except ValueError as e:  # (huggingface_hub's validation of the repo id and file name)
        raise ModelNotFound(f"not a model repository id or file name for the hub: {repo}:{name} ({e})") from None


def _download(repo: str, prefixes: tuple[str, ...]) -> Path:
    from huggingface_hub import try_to_load_from_cache

    offline = hub_offline()
    if not offline and not isinstance(try_to_load_from_cache(repo, "config.json"), str):
        print(f"minicpm: fetching {repo} from the Hugging Face hub (the speech part, once; later runs use the "
              "local cache)", file=sys.stderr, flush=True)
    local = offline or not hub_reachable()  # (a cached model is still used without a network)
    for name in SMALL_FILES:
        hub_file(repo, name, local_only=local)
    hub_file(repo, "quantize_config.json", required=False, local_only=local)  # GPTQ checkpoints only
    root = hub_file(repo, "config.json", local_only=local).parent
    index = hub_file(repo, INDEX, required=False, local_only=local)
    if index is None:
        hub_file(repo, SINGLE, local_only=local)
    else:
        weight_map = _read_index(index)
        for shard in sorted({f for k, f in weight_map.items() if k.startswith(prefixes)}):
            hub_file(repo, shard, local_only=local)
    return root


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"cannot read {path}: weight_map is not an object")
    return weight_map


class Config(dict):
    """An object of config.json (the top level, tts_config, ...): a field the model code needs and the
    file lacks is the checkpoint's error, one line naming both, not a KeyError of ours."""

    path: Path

    def __getitem__(self, key):
        try:
            return super().__getitem__(key)
        except KeyError:
            raise CheckpointError(f"{self.path} lacks the field '{key}': not a MiniCPM-o checkpoint's config") from None


def read_config(root: Path) -> Config:
    path = root / "config.json"

    def config(fields: dict) -> Config:
        c = Config(fields)
        c.path = path
        return c

    try:
        data = json.loads(path.read_text(), object_hook=config)
    except FileNotFoundError:
        raise CheckpointError(f"config.json missing in {root}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, Config):
        raise CheckpointError(f"cannot read {path}: not a JSON object")
    return data


class Checkpoint:
    """Tensor access by name over the safetensors file(s) of one checkpoint directory."""

    def __init__(self, root: Path):
        self.root = root
        if (root / INDEX).is_file():
            self.weight_map = _read_index(root / INDEX)
        elif (root / SINGLE).is_file():
            self.weight_map = None
        else:
            raise CheckpointError(f"no {SINGLE} or {INDEX} in {root}")
        self._headers: dict[str, dict[str, Entry]] = {}
        self._read: dict[str, Tensor] = {}  # prefetched tensors, until `tensor` hands them out

    def _file_of(self, key: str) -> str:
        if self.weight_map is None:
            return SINGLE
        try:
            return self.weight_map[key]
        except KeyError:
            raise CheckpointError(f"tensor {key} is not in {self.root / INDEX}") from None

    def keys(self, prefix: str) -> list[str]:
        """Names under `prefix`, read from the index or the file header only."""
        if self.weight_map is not None:
            return sorted(k for k in self.weight_map if k.startswith(prefix))
        return sorted(k for k in self._header(SINGLE) if k.startswith(prefix))

    def shape(self, key: str) -> tuple[int, ...]:
        name = self._file_of(key)
        try:
            return self._header(name)[key].shape
        except KeyError:
            raise CheckpointError(f"tensor {key} missing from {self.root / name}") from None

    def _header(self, name: str) -> dict[str, Entry]:
        if name not in self._headers:
            path = self.root / name
            try:
                self._headers[name] = read_header(path)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint file missing: {path}") from None
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"cannot read {path} (truncated or corrupt?): {e}") from None
        return self._headers[name]

    def prefetch(self, keys: Iterable[str], device="cpu") -> None:
        """Read these tensors now, in their file dtype onto `device`: each one's bytes once, a pass
        over each file with reads overlapping the copies to the GPU (`tensorio`). `tensor` then hands
        them out, converting the dtype where asked on the device itself."""
        entries = {}
        for key in keys:
            if key in self._read:
                continue
            name = self._file_of(key)
            header = self._header(name)
            if key not in header:
                raise CheckpointError(f"tensor {key} missing from {self.root / name}")
            entries[key] = header[key]
        try:
            self._read.update(read_tensors(entries, torch.device(device)))
        except OSError as e:
            raise CheckpointError(f"cannot read {self.root}: {e}") from None

    def tensor(self, key: str, dtype: torch.dtype | None = None, device=None) -> Tensor:
        """One tensor in `dtype` (default: its file's) on `device` (default: where `prefetch` put it,
        or the CPU)."""
        if key not in self._read:
            self.prefetch([key], device or "cpu")
        t = self._read.pop(key)
        return t.to(device=device or t.device, dtype=dtype or t.dtype)

    def state_dict(self, prefix: str, dtype: torch.dtype | None = None, device="cpu",
                   skip: tuple[str, ...] = ()) -> dict[str, Tensor]:
        """{name without prefix: tensor} for every tensor under prefix (minus `skip` sub-prefixes)."""
        return {
            k[len(prefix):]: self.tensor(k, dtype, device)
            for k in self.keys(prefix)
            if not k[len(prefix):].startswith(skip)
        }


def load_module(module: torch.nn.Module, ckpt: Checkpoint, prefix: str, dtype: torch.dtype, device,
                derived: dict[str, Tensor] | None = None) -> None:
    """Fill a module built on the meta device from `prefix`-ed checkpoint tensors.

    Names and shapes are checked against the file headers before any data is read. `derived`
    supplies parameters that are computed rather than stored (e.g. folded weight-norm heads).
    """
    derived = derived or {}
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    for k, shape in expected.items():
        got = tuple(derived[k].shape) if k in derived else ckpt.shape(prefix + k)
        if got != shape:
            raise CheckpointError(f"tensor {prefix}{k} has shape {list(got)}, expected {list(shape)}")
    ckpt.prefetch([prefix + k for k in expected if k not in derived], device)
    tensors = {k: derived[k] if k in derived else ckpt.tensor(prefix + k, dtype, device) for k in expected}
    module.load_state_dict(tensors, strict=True, assign=True)
