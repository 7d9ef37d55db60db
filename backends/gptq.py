"""The GPTQ checkpoint format (AutoGPTQ "gptq" v1) and a 4-bit Linear that runs it with torch's kernel.

Format, per quantized Linear with `in` inputs and `out` outputs (spec §5): `qweight` int32
[in/8, out], eight 4-bit values packed along the input dim, value k of a word in bits 4k..4k+3;
`qzeros` int32 [groups, out/8], packed the same way along the output dim and stored minus one;
`scales` [groups, out]; `g_idx` int32 [in], the group of each input (act-order permutes them);
`bias` where the layer has one. The weight is W[i, o] = scales[g, o] * (q[i, o] - (zeros[g, o] + 1))
with g = g_idx[i]. `group_size` -1 means one group for all inputs.

`Int4Linear` repacks this for `aten._weight_int4pack_mm` (CUDA) or its `_for_cpu` twin: inputs are
permuted so that every group is contiguous, a per-channel group (-1) is repeated over 128-wide
groups (exact), and the zero point becomes the kernel's additive form, W = (q - 8) * s + s * (8 - z).
Nothing here depends on AutoGPTQ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

BITS = 4
PACK = 32 // BITS  # values per int32
KERNEL_GROUPS = (32, 64, 128, 256)
SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)


def unpack_rows(packed: Tensor) -> Tensor:
    """int32 [r, c] -> int32 [r * 8, c]: value k of word [r, c] becomes row r * 8 + k."""
    v = (packed[:, None, :] >> SHIFTS.to(packed.device)[None, :, None]) & 0xF  # (r, 8, c)
    return v.reshape(-1, packed.shape[1])


def pack_rows(values: Tensor) -> Tensor:
    """Inverse of unpack_rows: int [r * 8, c] with values 0..15 -> int32 [r, c] (bit 31 may be set:
    the word is the same 32 bits reinterpreted as signed, as AutoGPTQ writes it)."""
    v = values.to(torch.int64).reshape(-1, PACK, values.shape[1])  # (r, 8, c)
    acc = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64, device=v.device)
    for k in range(PACK):
        acc |= v[:, k] << (BITS * k)
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def unpack(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> q [in, out] (0..15), zeros [groups, out] (true zero points, stored value + 1), scales, g_idx."""
    q = unpack_rows(qweight)
    zeros = unpack_rows(qzeros.T.contiguous()).T + 1  # packed along out: unpack the transpose
    return q, zeros, scales, g_idx.long()


def dequantize(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor) -> Tensor:
    """-> W [out, in] in float32 (the layout of nn.Linear.weight)."""
    q, zeros, s, g = unpack(qweight, qzeros, scales, g_idx)
    return (s.float()[g] * (q.float() - zeros.float()[g])).T.contiguous()


def quantize(w: Tensor, group_size: int, *, sym: bool = True, g_idx: Tensor | None = None) -> dict[str, Tensor]:
    """Round-to-nearest quantization of W [out, in] into the GPTQ tensors (for synthetic checkpoints
    and tests; the real checkpoints come from the GPTQ algorithm, same format)."""
    out, n_in = w.shape
    dev = w.device
    if g_idx is None:
        g_idx = torch.arange(n_in, device=dev) // (group_size if group_size > 0 else n_in)
    g_idx = g_idx.to(dev)
    groups = int(g_idx.max()) + 1
    wt = w.T.float()  # (in, out)
    scales = torch.zeros(groups, out, device=dev)
    zeros = torch.zeros(groups, out, dtype=torch.int32, device=dev)
    for gi in range(groups):
        rows = wt[g_idx == gi]
        if sym:
            s = rows.abs().amax(0).clamp(min=1e-8) / 7.5
            z = torch.full((out,), 8, dtype=torch.int32, device=dev)
        else:
            lo, hi = rows.amin(0), rows.amax(0)
            s = ((hi - lo) / 15).clamp(min=1e-8)
            # z = 0 would be stored as -1, which v1 readers (AutoGPTQ's and ours) read back as 16
            z = torch.round(-lo / s).clamp(1, 15).to(torch.int32)
        scales[gi], zeros[gi] = s, z
    q = torch.round(wt / scales[g_idx] + zeros[g_idx]).clamp(0, 15).to(torch.int32)
    # zero points are stored minus one ("gptq" v1), in 4 bits, packed along the output dim
    stored = ((zeros - 1) & 0xF).T.contiguous()  # (out, groups)
    return {"qweight": pack_rows(q), "qzeros": pack_rows(stored).T.contiguous(),
            "scales": scales.half(), "g_idx": g_idx.to(torch.int32)}


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4 bits, on torch's int4 matmul kernel (CUDA or CPU)."""

    def __init__(self, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bias: Tensor | None,
                 dtype: torch.dtype, device):
        super().__init__()
        q, zeros, s, g = (t.to(device) for t in unpack(qweight, qzeros, scales, g_idx))
        n_in, n_out = q.shape
        # Make groups contiguous along the input dim (act-order stores them interleaved).
        perm = torch.argsort(g, stable=True)
        self.register_buffer("perm", None if torch.equal(perm, torch.arange(n_in, device=device)) else perm,
                             persistent=False)
        g = g[perm]
        counts = torch.bincount(g)
        group = int(counts[0])
        if not torch.all(counts == group):
            raise ValueError("GPTQ groups of unequal size are not supported")
        kernel_group = group if group in KERNEL_GROUPS else (128 if group % 128 == 0 else None)
        if kernel_group is None:
            raise ValueError(f"GPTQ group size {group} is not supported by the int4 kernel")
        # per-(kernel)group scale and additive zero, (in/kernel_group, out, 2)
        rows = torch.arange(0, n_in, kernel_group, device=device)
        s_rows, z_rows = s.float()[g[rows]], zeros.float()[g[rows]]
        sz = torch.stack([s_rows, s_rows * (8 - z_rows)], dim=-1).to(dtype).contiguous()
        wq = q[perm].T.contiguous()  # (out, in), values 0..15
        self.cuda_kernel = wq.device.type == "cuda"
        tiles = next(t for t in (8, 4, 2) if n_in % (t * 16) == 0)  # the CUDA layout's K tiling
        if self.cuda_kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (wq[:, ::2] << 4 | wq[:, 1::2]).to(torch.uint8), tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(wq.to(torch.int32), tiles)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", sz, persistent=False)
        self.group = kernel_group
        self.in_features, self.out_features = n_in, n_out
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        mm = torch.ops.aten._weight_int4pack_mm if self.cuda_kernel else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(x.contiguous(), self.packed, self.group, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2


def interleave(rows: Tensor) -> Tensor:
    """(n, c) -> (ceil(n / 4), c, 4): the rows of every four interleaved (zero rows pad n), the
    4-bit layout of the Triton kernels (backends/kernels/matvec.py `_mac`)."""
    n, c = rows.shape
    if n % 4:
        rows = torch.cat([rows, rows.new_zeros(4 - n % 4, c)])
    return rows.reshape(-1, 4, c).transpose(1, 2).contiguous()


def pair_nibbles(words: Tensor) -> Tensor:
    """GPTQ words (value j in bits 4j..4j+3) -> the kernels' order: value j in nibble j/2 for even
    j and 4 + j//2 for odd j, so that one AND of the word shifted by 4p gives values 2p and 2p + 1
    in its two 16-bit halves (backends/kernels/q4.py `_q4_mm`)."""
    w = words.long() & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for j in range(8):
        out |= ((w >> (4 * j)) & 0xF) << (4 * (j // 2 + 4 * (j % 2)))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def kernel_words(q: Tensor) -> Tensor:
    """4-bit values q (n, k) 0..15, a row per output, -> the words of the kernels' layout (what
    `Q4Linear.packed` holds): eight values to an int32 along k in `pair_nibbles` order, the rows of
    every four interleaved. Packed in slices of rows (`pack_rows` works in int64)."""
    rows = torch.cat([pack_rows(q[i:i + 4096].T).T for i in range(0, q.shape[0], 4096)])
    return interleave(pair_nibbles(rows))


def deinterleave(words: Tensor, n: int) -> Tensor:
    """Inverse of interleave: (ceil(n / 4), c, 4) -> (n, c)."""
    return words.transpose(1, 2).reshape(-1, words.shape[1])[:n]


class Q4Linear(nn.Module):
    """y = x W^T + b with W in 4 bits, for the Triton kernels (backends/kernels/): one-token steps
    read it inside the fused decode kernels (`kernel_weight`), prefills go through `q4_linear`.

    Layout: the GPTQ values packed eight to an int32 along the input dim as in `qweight` (their
    nibbles reordered by `pair_nibbles`), but a row per output and the rows of every four
    interleaved, `packed` (ceil(out/4), in/8, 4); float32
    `scales` and true `zeros` (out, groups). Act-order checkpoints with several groups keep a
    `perm` of the inputs (groups made contiguous); with one group (the official per-channel
    checkpoint) the order of inputs does not matter and none is kept.
    """

    def __init__(self, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bias: Tensor | None,
                 dtype: torch.dtype, device):
        super().__init__()
        qweight, g = qweight.to(device), g_idx.to(device).long()
        n_in, n_out = qweight.shape[0] * PACK, qweight.shape[1]
        if g.numel() != n_in:
            raise ValueError(f"g_idx has {g.numel()} entries for {n_in} inputs")
        zeros = unpack_rows(qzeros.to(device).T.contiguous()).T + 1  # (groups, out): small
        s = scales.to(device)
        counts = torch.bincount(g)
        group = int(counts[0])
        if not torch.all(counts == group) or group & (group - 1) and group != n_in:
            raise ValueError(f"GPTQ groups must be of one power-of-two size (got sizes {counts.unique().tolist()})")
        perm = torch.argsort(g, stable=True)
        identity = len(counts) == 1 or torch.equal(perm, torch.arange(n_in, device=device))
        self.register_buffer("perm", None if identity else perm, persistent=False)
        if identity:  # the words already hold eight consecutive inputs of an output: transpose only
            rows_packed = qweight.T
        else:  # act-order with groups: unpack, make every group contiguous, pack again
            q = unpack_rows(qweight)[perm]
            g = g[perm]
            rows_packed = pack_rows(q).T
        rows = torch.arange(0, n_in, group, device=device)  # first input of each group
        self.register_buffer("packed", interleave(pair_nibbles(rows_packed)), persistent=False)
        self.register_buffer("scales", s.float()[g[rows]].T.contiguous(), persistent=False)
        self.register_buffer("zeros", zeros.float()[g[rows]].T.contiguous(), persistent=False)
        self.group = group
        self.in_features, self.out_features = n_in, n_out
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)

    @classmethod
    def cat(cls, parts: list[Q4Linear]) -> Q4Linear:
        """The projections stacked along the outputs (q/k/v, gate/up), as one Linear."""
        first = parts[0]
        if any(p.perm is not None for p in parts) or len({(p.in_features, p.group) for p in parts}) > 1:
            raise ValueError("only 4-bit Linears with the same inputs and groups and no act-order permutation stack")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.register_buffer("perm", None, persistent=False)
        for name in ("scales", "zeros"):
            out.register_buffer(name, torch.cat([getattr(p, name) for p in parts]), persistent=False)
        rows = torch.cat([deinterleave(p.packed, p.out_features) for p in parts])
        out.register_buffer("packed", interleave(rows), persistent=False)
        out.group, out.in_features = first.group, first.in_features
        out.out_features = sum(p.out_features for p in parts)
        biases = [p.bias for p in parts]
        out.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), requires_grad=False)
        return out

    def kernel_weight(self):
        from .kernels.common import Weight

        return Weight(self.packed, self.scales, self.zeros, self.group)

    invariant = False  # backends/invariant.py: every token count on `q4_invariant`

    def forward(self, x: Tensor, pdl: bool = False) -> Tensor:
        """`pdl` (invariant only): where the product runs on q4_chain, launched as a programmatic
        dependent of the previous kernel (backends/invariant.py's fused token)."""
        from .kernels.q4 import FALLBACK, q4_eager, q4_invariant, q4_linear

        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x, w = x.contiguous(), self.kernel_weight()
        b = self.bias
        kernel = (lambda: q4_invariant(x, w, b, pdl)) if self.invariant else (lambda: q4_linear(x, w, b))
        y = FALLBACK.guard(kernel, lambda: q4_eager(x, w, b), x.device)
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros))


GPTQ_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_gptq_checkpoint(src: str | Path, out_dir: str | Path, *, group_size: int = -1, desc_act: bool = False,
                          sym: bool = True, seed: int = 0, dequantized_to: str | Path | None = None,
                          device: str | torch.device = "cpu") -> Path:
    """Convert a checkpoint in the official layout (one file or shards with an index) into the layout
    of openbmb/MiniCPM-o-2_6-int4: every LLM decoder Linear becomes GPTQ tensors (qweight, qzeros,
    scales, g_idx; biases kept), plus quantize_config.json; everything else is copied. With
    `desc_act`, inputs are assigned to groups in a random order (act-order). `dequantized_to` also
    writes the same checkpoint with the dequantized weights in place (the reference for tests).
    `device`: where the quantizing runs (a GPU makes a full-size checkpoint in seconds)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    index = src / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    weight_map = {}
    g = torch.Generator().manual_seed(seed)
    for shard in shards:
        tensors = load_file(src / shard, device=str(device))
        deq = dict(tensors) if dequantized_to is not None else None
        for name in [n for n in tensors if n.startswith("llm.model.layers.") and n.endswith(".weight")]:
            if not any(f".{layer}.weight" in name for layer in GPTQ_LAYERS):
                continue
            w = tensors.pop(name).float()
            n_in = w.shape[1]
            size = n_in if group_size == -1 else group_size
            g_idx = torch.arange(n_in) // size
            if desc_act:
                g_idx = g_idx[torch.randperm(n_in, generator=g)]
            q = quantize(w, size, sym=sym, g_idx=g_idx.to(w.device))
            if group_size == -1:
                q["g_idx"] = torch.zeros(n_in, dtype=torch.int32, device=w.device)
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{k}": v for k, v in q.items()})
            if deq is not None:
                deq[name] = dequantize(**q).cpu()  # float32: exactly the weights the int4 path computes with
        save_file({k: v.cpu() for k, v in tensors.items()}, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        if deq is not None:
            Path(dequantized_to).mkdir(parents=True, exist_ok=True)
            save_file({k: v.cpu() for k, v in deq.items()}, str(Path(dequantized_to) / shard), metadata={"format": "pt"})
    if index.is_file():
        meta = json.loads(index.read_text()).get("metadata", {})
        (out / index.name).write_text(json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))},
                                                 indent=2) + "\n")
    (out / "quantize_config.json").write_text(json.dumps({
        "bits": 4, "group_size": group_size, "damp_percent": 0.01, "desc_act": desc_act, "static_groups": False,
        "sym": sym, "true_sequential": True, "lm_head": False, "quant_method": "gptq", "checkpoint_format": "gptq",
    }, indent=2) + "\n")
    if dequantized_to is not None:
        for item in src.iterdir():
            if not item.name.endswith(".safetensors"):
                target = Path(dequantized_to) / item.name
                (shutil.copytree(item, target, dirs_exist_ok=True) if item.is_dir() else shutil.copy2(item, target))
    return out
