"""A bf16 weight in AMX tile order (linear_amx.c's layout), laid out once at load for our many-row product.

Strips of STRIP output columns, each strip's k-blocks of K_BLOCK inputs in turn, each k-block two B tiles of 16 rows
holding the inputs in pairs: tiles [n32 / 32][k / 32][2][16][16][2], n32 = n rounded up to STRIP with zero
columns. A weight whose k is not a multiple of K_BLOCK is not tileable (the caller keeps another form)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

STRIP = 32  # output columns per strip (two B tiles of 16)
K_BLOCK = 32  # inputs per tile product (a tile row's 64 bytes of bf16)


@dataclass(frozen=True, slots=True)
class AmxWeight:
    """`tiles` a flat bf16 tensor in the layout above for an n x k weight."""

    tiles: torch.Tensor
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes


def tileable(weight: torch.Tensor) -> bool:
    """Whether `weight` is one n x k matrix with k a whole number of K_BLOCKs."""
    return weight.dim() == 2 and weight.shape[1] % K_BLOCK == 0 and weight.shape[1] > 0 and weight.shape[0] > 0


def pack(weight: torch.Tensor) -> AmxWeight:
    """`weight` [n, k] (any float dtype, rounded to bf16 to nearest even) in tile order."""
    if not tileable(weight):
        raise ValueError(f"amx_weight.pack wants one matrix with inputs a multiple of {K_BLOCK}, "
                         f"got {tuple(weight.shape)}")
    n, k = weight.shape
    n32 = -(-n // STRIP) * STRIP
    w = weight.to(torch.bfloat16)
    if n32 != n:
        w = torch.cat([w, w.new_zeros(n32 - n, k)])
    # [strip, tile, column, k-block, pair, half] -> [strip, k-block, tile, pair, column, half]
    tiles = w.reshape(n32 // STRIP, 2, 16, k // K_BLOCK, K_BLOCK // 2, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return AmxWeight(tiles.reshape(-1), n, k)


def unpack(weight: AmxWeight) -> torch.Tensor:
    """The bf16 matrix [n, k] back (tests; the inverse of `pack`)."""
    n32 = -(-weight.n // STRIP) * STRIP
    tiles = weight.tiles.reshape(n32 // STRIP, weight.k // K_BLOCK, 2, K_BLOCK // 2, 16, 2)
    return tiles.permute(0, 2, 4, 1, 3, 5).reshape(n32, weight.k)[: weight.n]
