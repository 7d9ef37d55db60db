"""The decoder's KV cache (minicpm_cli/models/transformer.py): every layer's K and V are views of one
tensor, `Decoder.kv_store`, so that a stream's start zeroes its row in one op (`reset_cache`)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minicpm_cli.models.transformer import Decoder, DecoderConfig

CONFIG = DecoderConfig(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, intermediate=48, rope_theta=10000.0,
                       norm_eps=1e-6, qkv_bias=False, max_positions=64)


class _Zeroes(TorchDispatchMode):
    """Counts the zeroing ops run under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ == "zero_"
        return func(*args, **(kwargs or {}))


def caches(d: Decoder) -> list[torch.Tensor]:
    return [t for layer in d.layers for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)]


@pytest.mark.parametrize("how", ["plain", "inference_mode", "moved"])
def test_a_row_is_zeroed_in_one_op(how):
    """`reset_cache(row)` zeroes that row in every layer's K and V and nothing else: in one op on
    `kv_store` (its views made in inference mode too, which have no `_base`); a decoder moved with
    `to` (copies) layer by layer, its old store let go."""
    d = Decoder(CONFIG)
    if how == "inference_mode":
        with torch.inference_mode():
            d.setup_cache(16, torch.float32, "cpu", rows=3)
    else:
        d.setup_cache(16, torch.float32, "cpu", rows=3)
    if how == "moved":
        d = d.to(torch.float64)
        assert d.kv_store is None
    with torch.inference_mode():
        for t in caches(d):
            t.normal_()
        before = [t.clone() for t in caches(d)]
        with _Zeroes() as zeroes:
            d.reset_cache(1)
    assert zeroes.count == (2 * CONFIG.n_layers if how == "moved" else 1)
    for t, old in zip(caches(d), before):
        assert not t[1].any() and torch.equal(t[0], old[0]) and torch.equal(t[2], old[2])


def test_a_replaced_layer_cache_turns_the_store_off():
    """A layer whose cache tensors were replaced (as tests put other rows in) is zeroed in its own
    tensors, not through the store."""
    d = Decoder(CONFIG)
    d.setup_cache(16, torch.float32, "cpu", rows=2)
    kv = d.layers[1].self_attn.kv_cache
    kv.k, kv.v = torch.ones_like(kv.k), torch.ones_like(kv.v)
    d.reset_cache(0)
    assert not kv.k[0].any() and not kv.v[0].any() and bool((kv.k[1] == 1).all())


def test_a_deep_copy_zeroes_its_own_rows():
    """A deep copy's store and caches share their new storage: its reset zeroes its own rows, and
    the original's stay."""
    import copy

    d = Decoder(CONFIG)
    d.setup_cache(16, torch.float32, "cpu", rows=2)
    e = copy.deepcopy(d)
    for t in caches(d) + caches(e):
        t.fill_(1.0)
    e.reset_cache(0)
    assert all(not t[0].any() and bool((t[1] == 1).all()) for t in caches(e))
    assert all(bool((t == 1).all()) for t in caches(d))
