"""4-bit weights on the Triton kernels (`Q4Linear`, the CUDA path of `--backend int4`): the prefill
matmul and the fused decode against the dequantized weights. Without a GPU the kernels run in
Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minicpm_cli.backends import int4
from minicpm_cli.backends.compile import CompiledLLM
from minicpm_cli.backends.gptq import Q4Linear, dequantize, quantize
from minicpm_cli.engine.checkpoint import Checkpoint, read_config
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.backends.gptq import write_gptq_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("group_size,desc_act,sym", [(-1, True, True), (-1, False, False), (32, True, True),
                                                    (64, False, False)])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_q4_linear_matches_dequantized(group_size, desc_act, sym, m):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    g_idx = None
    if desc_act:
        size = group_size if group_size > 0 else 256
        g_idx = (torch.arange(256) // size)[torch.randperm(256)]
    t = quantize(w, group_size, sym=sym, g_idx=g_idx)
    bias = torch.randn(48)
    lin = Q4Linear(**t, bias=bias, dtype=torch.float32, device=DEVICE)
    x = torch.randn(m, 256)
    ref = x @ dequantize(**t).T + bias
    torch.testing.assert_close(lin(x.to(DEVICE)).cpu(), ref, rtol=1e-5, atol=1e-5)
    assert (lin.perm is not None) == (desc_act and group_size > 0)  # one group: order is irrelevant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [None, (64, 64, 64, 4, 1, 3), (16, 64, 32, 4, 2, 4), (16, 16, 32, 4, 2, 2)])
def test_prefill_product_matches_dequantized(cfg, dtype):
    """The prefill product of a one-group 4-bit weight (`q4_mm`) in launch shapes that split K over
    programs, tokens in several tiles, and rows and tokens past the tiles' edges: the dequantized
    product with the bias (float32: to its rounding; 16-bit, in Triton's interpreter the 2^m + q
    patterns that the GPU's `_pairs16` starts from: to the output's rounding)."""
    from minicpm_cli.backends.kernels.q4 import q4_mm

    torch.manual_seed(3)
    t = quantize(torch.randn(72, 320) * 0.05, -1, sym=False)
    lin = Q4Linear(**t, bias=torch.randn(72), dtype=dtype, device=DEVICE)
    x = torch.randn(37, 320).to(dtype)
    ref = x.float() @ dequantize(**t).T + lin.bias.float().cpu()
    y = q4_mm(x.to(DEVICE), lin.kernel_weight(), lin.bias, cfg).cpu()
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # two 16-bit steps (the interpreter truncates)
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


def test_split_products_leave_their_kept_counters_zeroed():
    """`q4_mm` split over K counts its programs in one kept buffer (no fill a call): every call
    leaves it zeroed, so the next call, larger or smaller, sums the same as the first; a buffer
    outgrown stays alive beside the new one."""
    from minicpm_cli.backends.kernels import q4

    torch.manual_seed(4)
    t = quantize(torch.randn(72, 320) * 0.05, -1, sym=False)
    lin = Q4Linear(**t, bias=None, dtype=torch.float32, device=DEVICE)
    x = torch.randn(37, 320).to(DEVICE)
    first = q4.q4_mm(x, lin.kernel_weight(), None, (16, 16, 32, 4, 2, 4))
    kept = q4._COUNTERS[x.device]
    assert kept and not kept[-1].any()
    q4.q4_mm(x[:5], lin.kernel_weight(), None, (16, 16, 32, 4, 2, 4))
    assert not kept[-1].any()
    assert torch.equal(q4.q4_mm(x, lin.kernel_weight(), None, (16, 16, 32, 4, 2, 4)), first)
    assert len(kept) == 1
    small = kept[0]
    assert q4._counters(x.device, small.numel() + 1).numel() == small.numel() + 1
    assert len(kept) == 2 and kept[0] is small  # (outgrown, kept: a captured graph may point at it)


@pytest.mark.gpu
def test_split_products_in_a_cuda_graph_keep_no_buffer_made_during_capture(monkeypatch):
    """Captured with no kept counters yet, a split `q4_mm` takes a buffer zeroed inside the graph and
    keeps none (a kept one would only be zeroed when the graph replays); every replay gives the
    eager product, bit for bit; the next eager call keeps a buffer, left zeroed."""
    from minicpm_cli.backends.gptq import kernel_words
    from minicpm_cli.backends.kernels import q4
    from minicpm_cli.backends.kernels.common import Weight

    torch.manual_seed(6)
    n, k = 4608, 3584
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    w = Weight(kernel_words(q), torch.rand(n, 1, device="cuda") * 0.01 + 0.001,
               torch.randint(1, 16, (n, 1), device="cuda").float(), k)
    x = torch.randn(16, k, device="cuda").to(torch.bfloat16)
    cfg = (64, 16, 64, 4, 3, 4)  # (split over K in four)
    eager = q4.q4_mm(x, w, None, cfg)  # (compiles the kernel outside the capture)
    monkeypatch.setattr(q4, "_COUNTERS", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = q4.q4_mm(x, w, None, cfg)
    assert q4._COUNTERS.get(x.device, []) == []
    for _ in range(3):
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
    assert torch.equal(q4.q4_mm(x, w, None, cfg), eager)  # (eager again: a kept buffer now, zeroed)
    assert len(q4._COUNTERS[x.device]) == 1 and not q4._COUNTERS[x.device][0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
def test_prefill_product_full_size_on_gpu(n, k):
    """`q4_mm` at its own launch shapes on Qwen2-7B's projection shapes, for every token tile size
    the prefill uses (up to `MM_MAX_M` tokens; float16 once: its own paired FMA), three fresh
    inputs each: the float32 product with the dequantized weights to the output's rounding, 0.5%
    (launch shapes of 128 rows x 64 inputs against 128 tokens gave errors of 2.8-4.5% of the output
    in tools/q4mm_sweep.py on an H100, Triton 3.6)."""
    from minicpm_cli.backends.gptq import kernel_words
    from minicpm_cli.backends.kernels.common import Weight
    from minicpm_cli.backends.kernels.q4 import q4_mm

    torch.manual_seed(5)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    z = torch.randint(1, 16, (n, 1), device="cuda").float()
    s = torch.rand(n, 1, device="cuda") * 0.01 + 0.001
    w = Weight(kernel_words(q), s, z, k)
    deq = (q.float() - z) * s
    del q
    for m, dtype in [(m, torch.bfloat16) for m in (1, 9, 32, 64, 100, 128, 200, 512)] + [(64, torch.float16)]:
        for _ in range(3):
            x = torch.randn(m, k, device="cuda").to(dtype)
            ref = x.float() @ deq.T
            y = q4_mm(x, w, None)
            assert y.dtype == dtype
            assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-3, (m, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dim,inter", [(3584, 18944), (512, 96)])
def test_cuda_gate_up_matches_float64(dim, inter):
    """`cuda_gate_up`, the int4 decode step's gate/up in CUDA C on the tensor cores, at Qwen2-7B's
    shape and a small one (one K-load a chunk), launched plainly and (Hopper) as a programmatic
    dependent: against the eager layer in float64 (the RMSNorm's output rounded to bfloat16, the
    exact 4-bit products, gate and up rounded, SiLU(gate) rounded, times up), within one bfloat16
    step on all rows but at most 1% and 2% of the largest everywhere; the same bits every launch."""
    from minicpm_cli.backends.gptq import kernel_words
    from minicpm_cli.backends.kernels.common import Weight
    from minicpm_cli.backends.kernels.decode import cuda_gate_up, cuda_gate_up_fits

    torch.manual_seed(7)
    q = torch.randint(0, 16, (2 * inter, dim), dtype=torch.int32, device="cuda")
    z = torch.randint(1, 16, (2 * inter, 1), device="cuda").float()
    s = torch.rand(2 * inter, 1, device="cuda") * 2e-3 + 1e-4
    w = Weight(kernel_words(q), s, z, dim)
    x = (torch.randn(dim, device="cuda") * 3).to(torch.bfloat16)
    gain = (1 + 0.1 * torch.randn(dim, device="cuda")).to(torch.bfloat16)
    assert cuda_gate_up_fits(w, x)
    inv = 1 / torch.sqrt((x.double() ** 2).mean() + 1e-6)
    b = ((x.double() * inv).to(torch.bfloat16).double() * gain.double()).to(torch.bfloat16).double()
    y = ((q.double() - z.double()) * b).sum(1) * s[:, 0].double()
    g, u = y[:inter].to(torch.bfloat16).double(), y[inter:].to(torch.bfloat16).double()
    ref = ((g / (1 + torch.exp(-g))).to(torch.bfloat16).double() * u).to(torch.bfloat16).double()
    outs = []
    for pdl in [False] + ([True] * 2 if torch.cuda.get_device_capability()[0] >= 9 else [False]):
        h = torch.full((inter,), float("nan"), dtype=torch.bfloat16, device="cuda")
        cuda_gate_up(w, x, gain, h, 1e-6, pdl=pdl)
        outs.append(h)
        err = (h.double() - ref).abs()
        assert ((err > ref.abs() * 2**-7 + 1e-6).double().mean() <= 0.01).item(), pdl
        assert (err.max() <= 0.02 * ref.abs().max()).item(), pdl
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
def test_q4_chain_gives_the_triton_products_bits(n, k):
    """`q4_chain` (backends/q4_chain.cu) at Qwen2-7B's shapes, 1 to 8 tokens, its one-token shape
    and others (16 and 32 rows a warp, short and long chunks), with and without a bias (zero points
    and scales per row): bit for bit `_q4_mm` with `q4_invariant`'s launch shape, which is what
    every token count's row gives (batch invariance). With the bias the sum, scale and bias take one
    FMA, as Triton's compiler contracts them: separate roundings differed in 1-4 of 4608 outputs."""
    from minicpm_cli.backends.gptq import kernel_words
    from minicpm_cli.backends.kernels.common import Weight
    from minicpm_cli.backends.kernels.q4 import (chain_shape, chain_whole, q4_chain, q4_chain_fits,
                                                 q4_invariant_config, q4_mm)

    g = torch.Generator(device="cuda").manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda", generator=g)
    z = torch.randint(1, 17, (n, 1), device="cuda", generator=g).float()
    s = torch.rand(n, 1, device="cuda", generator=g) * 1e-2 + 1e-3
    w = Weight(kernel_words(q), s, z, k)
    shapes = [{"rows": 32, "warps": 2, "steps": 8, "stages": 3}, {"rows": 16, "warps": 2, "steps": 16, "stages": 2}]
    for m in (1, 2, 3, 8):
        x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.bfloat16)
        assert q4_chain_fits(x, w)
        for bias in (None, (torch.randn(n, device="cuda", generator=g) * 2).to(torch.bfloat16)):
            ref = q4_mm(x, w, bias, cfg=q4_invariant_config(m, w))
            ran = [shape for shape in shapes + [chain_shape(m, w) or shapes[0]]
                   if chain_whole(m, w, shape["steps"])]  # (the parts depend on the GPU's SM count)
            assert ran, (m, n, k)
            for shape in ran:
                assert torch.equal(q4_chain(x, w, bias, **shape), ref), (m, shape, bias is None)
            assert torch.equal(q4_mm(x[:1], w, bias, cfg=q4_invariant_config(1, w))[0], ref[0])


def test_q4_chain_takes_one_token_and_a_few_of_down_with_the_tritons_parts():
    """`chain_shape`: a shape for one token of each of Qwen2-7B's projections, for 2-8 tokens only
    of down (long rows); `chain_defines` cuts K where `q4_invariant` does."""
    from minicpm_cli.backends.kernels.common import Weight, split_k
    from minicpm_cli.backends.kernels.q4 import chain_defines, chain_shape, q4_invariant_config

    def weight(n, k):
        return Weight(torch.zeros((n + 3) // 4, k // 8, 4, dtype=torch.int32), torch.ones(n, 1), torch.zeros(n, 1), k)

    for (n, k), want in {(37888, 3584): (32, None), (3584, 18944): (16, 32), (4608, 3584): (32, None),
                         (3584, 3584): (16, None)}.items():
        w = weight(n, k)
        shape = chain_shape(1, w)
        assert (shape["rows"], (chain_shape(8, w) or {}).get("rows")) == want, (n, k)
        d = dict(chain_defines(1, w, False, False, **(shape or {})))
        assert (d["SPLIT"], d["KS"]) == split_k(k, 64, q4_invariant_config(1, w)[5])
        assert d["MT"] == 1 and dict(chain_defines(5, w, True, False))["MT"] == 8
    assert chain_shape(1, weight(37888, 3584 + 64)) is None  # (K not whole 16-step chunks in each part)


@pytest.mark.parametrize("pipe", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group,block_k,split", [(-1, 64, 4), (-1, 32, 1), (-1, 64, 1), (-1, 32, 3), (32, 32, 3),
                                                 (64, 64, 1)])
def test_split_k_gemv_matches_dequantized(sym, group, block_k, split, pipe):
    """A one-row product over K-blocks of 256 inputs (8, 4 or 3 a program),
    split over K (`split` programs a row block), added to a residual in place, with the words
    prefetched into registers or (`pipe`) through Triton's pipelining: the rows of the
    dequantized product; the counters end at zero."""
    from minicpm_cli.backends.kernels.common import SplitScratch, Weight
    from minicpm_cli.backends.kernels.matvec import gemv

    torch.manual_seed(2)
    t = quantize(torch.randn(40, 256) * 0.05, group, sym=sym)
    w = Q4Linear(**t, bias=None, dtype=torch.float32, device=DEVICE).kernel_weight()
    assert isinstance(w, Weight) and w.q4
    y, x = torch.randn(256), torch.randn(40)
    ref = x + y @ dequantize(**t).T
    scratch = SplitScratch(DEVICE)
    for _ in range(2):  # the second call reuses the scratch: the counters were reset
        out = x.to(DEVICE, copy=True)
        gemv(w, y.to(DEVICE), out, out, rows=8, block_k=block_k, split=split, scratch=scratch, stages=3 if pipe else 1,
             pipe=pipe)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
        assert not scratch.count.any()
    if split > 1:
        assert scratch.part.numel() >= 5 * split * 8


def test_pair_nibbles_by_hand():
    """Value j of a GPTQ word moves to nibble j/2 (even j) or 4 + j//2 (odd j): shifted by 4p and
    masked with 0x000F000F, a word gives values 2p and 2p + 1 (what `_q4_mm` reads)."""
    from minicpm_cli.backends.gptq import pair_nibbles

    words = torch.tensor([0x76543210, -0x789ABCE0, 0], dtype=torch.int32)  # -0x789ABCE0 = 0x87654320
    assert pair_nibbles(words).tolist() == [0x75316420, 0x86427530 - 2**32, 0]
    for p in range(4):
        pair = (pair_nibbles(words[:1]) >> (4 * p)) & 0x000F000F
        assert pair.tolist() == [(2 * p + 1) << 16 | 2 * p]


def test_kernel_words_are_q4linear_words():
    """`kernel_words` of a weight's 4-bit values gives the words that Q4Linear makes of its GPTQ
    tensors."""
    from minicpm_cli.backends.gptq import kernel_words, unpack_rows

    torch.manual_seed(4)
    t = quantize(torch.randn(40, 64) * 0.05, -1)
    lin = Q4Linear(**t, bias=None, dtype=torch.float32, device="cpu")
    assert torch.equal(kernel_words(unpack_rows(t["qweight"]).T), lin.packed)


def test_q4_linears_stack():
    torch.manual_seed(1)
    parts = [quantize(torch.randn(n, 128) * 0.05, -1) for n in (32, 16, 16)]
    lins = [Q4Linear(**t, bias=torch.randn(t["scales"].shape[1]), dtype=torch.float32, device=DEVICE) for t in parts]
    fused = Q4Linear.cat(lins)
    x = torch.randn(3, 128, device=DEVICE)
    torch.testing.assert_close(fused(x), torch.cat([lin(x) for lin in lins], -1), rtol=1e-6, atol=1e-6)
    assert fused.out_features == 64 and fused.weight_bytes == sum(lin.weight_bytes for lin in lins)


@pytest.fixture(scope="module")
def channel(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    return write_gptq_checkpoint(tiny_dir, root / "int4", group_size=-1, desc_act=True, dequantized_to=root / "deq"), root / "deq"


@pytest.mark.parametrize("blocks", [None, "registers", "pipe"])
def test_fused_4bit_decode_matches_dequantized_model(channel, blocks):
    """The official layout (per channel, act-order): prompt and greedy tokens decoded on the fused
    kernels with 4-bit weights equal the float model on the dequantized weights; with `blocks`, the
    kernels take their inputs in several K-blocks (qkv and o 4 of 16, gate/up 2 of 32, down 8 of 16
    over 3 programs: 3, 3 and 2), the next block's words prefetched into registers or (pipe)
    through Triton's pipelining, with programs of four rows for q/k/v and gate/up."""
    from minicpm_cli.backends.kernels.decode import kernels_scratch

    int4_dir, deq_dir = channel
    model = int4.build(Checkpoint(int4_dir), read_config(int4_dir), device=DEVICE, dtype=torch.float32, triton=True)
    llm = CompiledLLM(model, max_len=256, fuse=True, use_triton=True)
    if blocks:
        td = llm.triton
        td.cfg = {"qkv": (8, 16, 4, 1), "o": (8, 16, 4, 1, 1), "gate_up": (8, 32, 4, 1), "down": (8, 16, 4, 1, 3)}
        if blocks == "pipe":
            td.cfg = {"qkv": (4, 16, 1, 3, 1), "o": (8, 16, 2, 3, 1, 1), "gate_up": (4, 32, 1, 3, 1),
                      "down": (8, 16, 1, 3, 3, 1)}
        td.scratch = kernels_scratch(td.cfg, td.weights[0][1], td.weights[0][3], DEVICE)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Q4Linear)
    ref = Synthesizer.load(str(deq_dir), backend="eager", device=DEVICE, dtype="float32")
    ids = ref.tokenizers.encode_llm("<|im_start|>user\nPlease read the text below.\nHello world.<|im_end|>\n")
    runs = []
    for stage in (ref.llm, llm):
        stage.reset()
        logits, hidden = stage.forward(ids)
        steps, hid = [logits.clone()], [hidden[-1].clone()]  # a backend's buffers: valid until the next call
        for _ in range(4):
            logits, hidden = stage.forward([int(logits.argmax())])
            steps.append(logits.clone())
            hid.append(hidden[-1].clone())
        runs.append((torch.stack(steps), torch.stack(hid)))
    (lr, hr), (lq, hq) = runs
    assert torch.equal(lr.argmax(-1), lq.argmax(-1))
    assert (lq - lr).abs().max() <= 1e-4 * lr.abs().max()
    assert (hq - hr).abs().max() <= 1e-4 * hr.abs().max()


def test_nvrtc_cubins_are_cached_on_disk_by_everything_they_depend_on(tmp_path, monkeypatch):
    """The CUDA C kernel's compile is paid once per source, options, GPU and NVRTC version: later
    processes read the CUBIN from the cache (the compiler is replaced by a counter here)."""
    from minicpm_cli.backends import cuda

    calls = []
    monkeypatch.setenv("MINICPM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda, "_nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(cuda, "compile_cubin", lambda src, name, arch, opts: calls.append((arch, opts)) or f"{arch}{opts}".encode())
    first = cuda._cached_compile("src", "k", "90", ("-DA=1",))
    assert cuda._cached_compile("src", "k", "90", ("-DA=1",)) == first and len(calls) == 1
    cuda._cached_compile("src", "k", "90", ("-DA=2",))  # other constants
    cuda._cached_compile("src", "k", "100", ("-DA=1",))  # another GPU
    cuda._cached_compile("src2", "k", "90", ("-DA=1",))  # another source
    monkeypatch.setattr(cuda, "_nvrtc_version", lambda: "13.1")
    cuda._cached_compile("src", "k", "90", ("-DA=1",))  # another compiler
    assert len(calls) == 5
    assert len(list((tmp_path / "nvrtc").glob("k-*.cubin"))) == 5 and not list((tmp_path / "nvrtc").glob(".*"))
