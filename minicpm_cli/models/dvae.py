"""The decoder half of MiniCPM-o 2.6's DVAE (`tts.dvae.*` in the checkpoint): audio codes -> log-mel.

In: codes (B, T, G*R) as sampled by the TTS head (4 per frame for the real model). Out: a natural-log
magnitude mel (B, n_mels, G*T) in Vocos's feature space, 2 mel frames per code frame. Each code is an
FSQ index of a grouped residual FSQ (vector-quantize-pytorch 1.18.5 `GroupedResidualFSQ`): the codes
of a frame form a (group, residual) grid, each decodes to digits of the levels' mixed radix, residual
r is scaled by (level-1)^-r, the residuals are summed and each group has its own `project_out`. The
groups are then interleaved in time (a reshape, not a learned upsampler), run through a ConvNeXt
stack with dilated depthwise convs, a bias-free `out_conv`, and scaled per mel bin by `coef`.

Parameter names are the checkpoint's with `tts.dvae.` removed. The encoder side (`encoder.*`,
`downsample_conv.*`) and the FSQ `project_in` are only used to encode mels and are not built here.
The op order follows the reference, so float32 results match it bit for bit on the same machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class DVAEConfig:
    groups: int = 2  # G: GFSQ groups, one per interleaved mel frame
    residuals: int = 2  # R: residual FSQ layers per group
    levels: tuple[int, ...] = (5, 5, 5, 5)  # FSQ levels; a code indexes prod(levels) points
    group_dim: int = 512  # width of each group's project_out (= decoder idim)
    idim: int = 512
    bn_dim: int = 128
    hidden: int = 256
    odim: int = 512
    n_layer: int = 12
    kernel: int = 7
    dilation: int = 2
    n_mels: int = 100

    def __post_init__(self):
        if self.group_dim != self.idim:
            raise ValueError(f"DVAE: project_out width {self.group_dim} != decoder input width {self.idim}")

    @property
    def num_vq(self) -> int:
        return self.groups * self.residuals

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor]) -> "DVAEConfig":
        """Sizes from tensor shapes (keys without `tts.dvae.`). The level values and the number of
        residual layers leave no trace in the weights; they keep the reference's 5 and 2."""
        rvq = r"vq_layer\.quantizer\.rvqs\.(\d+)\.project_out\.weight"
        blocks = r"decoder\.decoder_block\.(\d+)\.dwconv\.weight"
        groups = 1 + max(int(m[1]) for k in sd if (m := re.fullmatch(rvq, k)))
        group_dim, code_dim = sd["vq_layer.quantizer.rvqs.0.project_out.weight"].shape
        bn_dim, idim, _ = sd["decoder.conv_in.0.weight"].shape
        n_mels, odim, _ = sd["out_conv.weight"].shape
        return cls(
            groups=groups,
            levels=(5,) * code_dim,
            group_dim=group_dim,
            idim=idim,
            bn_dim=bn_dim,
            hidden=sd["decoder.conv_in.2.weight"].shape[0],
            odim=odim,
            n_layer=1 + max(int(m[1]) for k in sd if (m := re.fullmatch(blocks, k))),
            kernel=sd["decoder.decoder_block.0.dwconv.weight"].shape[-1],
            n_mels=n_mels,
        )


class ConvNeXtBlock(nn.Module):
    """Vocos's ConvNeXt block with a dilated depthwise conv; the layer scale is named `coef`."""

    def __init__(self, dim: int, intermediate: int, kernel: int, dilation: int):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel, padding=dilation * (kernel // 2), dilation=dilation, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate)
        self.pwconv2 = nn.Linear(intermediate, dim)
        self.coef = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # (B, C, T)
        y = self.norm(self.dwconv(x).transpose(1, 2))  # (B, T, C)
        y = self.pwconv2(F.gelu(self.pwconv1(y))) * self.coef
        return y.transpose(1, 2) + x


class ConvStack(nn.Module):
    """`DVAEDecoder` of the reference: conv_in (k3, GELU, k3) -> ConvNeXt blocks -> 1x1 conv_out."""

    def __init__(self, c: DVAEConfig):
        super().__init__()
        self.conv_in = nn.Sequential(
            nn.Conv1d(c.idim, c.bn_dim, 3, 1, 1), nn.GELU(), nn.Conv1d(c.bn_dim, c.hidden, 3, 1, 1)
        )
        self.decoder_block = nn.ModuleList(
            ConvNeXtBlock(c.hidden, 4 * c.hidden, c.kernel, c.dilation) for _ in range(c.n_layer)
        )
        self.conv_out = nn.Conv1d(c.hidden, c.odim, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.decoder_block:
            x = block(x)
        return self.conv_out(x)


class GroupedFSQ(nn.Module):
    """Index -> vector half of `GroupedResidualFSQ`; only the per-group `project_out` is learned."""

    def __init__(self, c: DVAEConfig):
        super().__init__()
        self.groups, self.residuals = c.groups, c.residuals
        self.quantizer = nn.Module()
        self.quantizer.rvqs = nn.ModuleList(
            nn.ModuleDict({"project_out": nn.Linear(len(c.levels), c.group_dim)}) for _ in range(c.groups)
        )
        levels = torch.tensor(c.levels)
        basis = torch.cumprod(torch.tensor((1,) + c.levels[:-1]), 0)
        index = torch.arange(int(levels.prod()))[:, None]
        half = levels // 2
        # The implicit codebook: digit d of each level becomes (d - l//2) / (l//2), e.g. {-1,-.5,0,.5,1}.
        self.register_buffer("codebook", (index // basis % levels - half) / half, persistent=False)
        self.register_buffer(
            "scales", torch.stack([(levels - 1.0) ** -r for r in range(c.residuals)]), persistent=False
        )

    def forward(self, codes: Tensor) -> Tensor:
        B, T, _ = codes.shape
        z = self.codebook[codes.reshape(B, T, self.groups, self.residuals)] * self.scales  # (B, T, G, R, D)
        out = [rvq.project_out(z[:, :, g].sum(2)) for g, rvq in enumerate(self.quantizer.rvqs)]
        return torch.cat(out, -1)  # (B, T, G * group_dim)


class DVAEDecoder(nn.Module):
    def __init__(self, c: DVAEConfig):
        super().__init__()
        self.config = c
        self.coef = nn.Parameter(torch.ones(1, c.n_mels, 1))
        self.vq_layer = GroupedFSQ(c)
        self.decoder = ConvStack(c)
        self.out_conv = nn.Conv1d(c.odim, c.n_mels, 3, 1, 1, bias=False)

    def forward(self, codes: Tensor) -> Tensor:
        """codes (B, T, G*R) int -> log-mel (B, n_mels, G*T)."""
        x = self.vq_layer(codes).transpose(1, 2)  # (B, G*C, T)
        B, _, T = x.shape
        # Group g of code frame t becomes mel frame G*t + g.
        x = x.view(B, self.config.groups, -1, T).permute(0, 2, 3, 1).flatten(2)  # (B, C, G*T)
        return self.out_conv(self.decoder(x)) * self.coef
