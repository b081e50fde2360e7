"""The Mamba-2 mixer (Dao & Gu, 2024) as used in Nemotron-H.

    zxBCdt = in_proj(u)                         # Order: [z, x, B, C, dt]
    xBC    = silu(causal_conv1d(x||B||C))       # depthwise, kernel k, with bias
    dt     = softplus(dt + dt_bias)             # [B, L, H], FP32; max(dt, dt_min_clamp) when set
    y      = SSD(x, dt, A = -exp(A_log), B, C) + D * x
    out    = out_proj(GatedRMSNorm(y, z))       # norm(y * silu(z)) in G groups

Only in_proj and out_proj are GEMMs (QuantLinear); the conv, scan, gate and norm stay in high
precision, the scan in FP32. At a document boundary the conv and the SSD state restart.

Initialisation (Mamba-2): A = -exp(A_log) with -A ~ U(a_init_range); dt_bias = softplus^-1(dt) with
dt log-uniform in [dt_min, dt_max]; D = 1; conv ~ PyTorch's Conv1d default. A_log, D and dt_bias are
FP32 and ``_no_weight_decay``: decaying A_log towards 0 would pull every head to the same decay rate.

On CUDA the pieces are views of in_proj's and the conv's outputs, and their consumers' backward kernels
write their gradients into one buffer, in_proj's output gradient (``model/grad_slab.py``): no copies.

Shape letters: B batch, L length, D d_model, E d_inner (= H P), H heads, P head dim, G groups,
N state, C conv channels (E + 2 G N), k conv kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inkling_fp4.model.cache import InferenceCache, MambaState
from inkling_fp4.model.compiled import cuda_kernel, fast_forms_on
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.conv import conv_silu, fused_conv_silu
from inkling_fp4.model.grad_slab import split_with_grad_slab
from inkling_fp4.model.mamba2_decode import fused_decode_applies, mamba_decode, mamba_decode_ref
from inkling_fp4.model.norm import GatedRMSNorm, at_least_fp32, output_dtype, skip_gated_rms_norm
from inkling_fp4.model.packing import Packing
from inkling_fp4.model.ssd import ssd
from inkling_fp4.precision.quant_linear import QuantLinear


@cuda_kernel("pointwise_kernels.dt_softplus")
def dt_softplus(dt_raw: torch.Tensor, dt_bias: torch.Tensor, ddt_into=None) -> torch.Tensor:
    """dt_raw: [..., H] (strided views fine); dt_bias: [H] -> softplus(dt_raw + dt_bias) in FP32 (or
    wider). ``ddt_into``: for the kernel's backward (``model/grad_slab.py``)."""
    return F.softplus(at_least_fp32(dt_raw) + dt_bias)


def _split_output(conv):
    """conv(xBC, weight, bias, seg) in the Triton conv's calling form, returning column blocks."""

    def conv_blocks(xBC, weight, bias, seg, blocks, dx_into=None):
        return conv(xBC, weight, bias, seg).split(blocks, -1)

    return conv_blocks


def conv_silu_for(impl: str, x: torch.Tensor, k: int):
    """The conv + SiLU for ``model.conv_impl``, as fn(xBC, weight, bias, seg, blocks, dx_into=None) -> the
    output's column blocks."""
    if torch.compiler.is_compiling():  # inside a compiled model the enclosing torch.compile fuses it
        return _split_output(conv_silu)
    if impl == "triton" or (impl == "auto" and x.is_cuda and k <= 4):
        from inkling_fp4.model.conv_triton import conv_silu_triton  # needs triton

        return conv_silu_triton  # the blocks' gradients reach its backward without a concatenation
    if impl == "compiled" or (impl == "auto" and x.is_cuda):  # auto: kernels wider than the Triton one's
        return _split_output(fused_conv_silu())
    return _split_output(conv_silu)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H, self.P, self.G, self.N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.d_state
        self.d_inner = cfg.d_inner
        self.conv_dim = self.d_inner + 2 * self.G * self.N
        self.in_widths = [self.d_inner, self.conv_dim, self.H]  # in_proj's output: z, xBC, dt
        self.xbc_widths = [self.d_inner, self.G * self.N, self.G * self.N]  # the conv's: x, B, C
        self.chunk_size = cfg.chunk_size
        self.ssd_impl = cfg.ssd_impl
        self.conv_impl = cfg.conv_impl
        self.dt_min_clamp = cfg.dt_min_clamp
        k = cfg.conv_kernel

        in_width = 2 * self.d_inner + 2 * self.G * self.N + self.H  # Order: [z, x, B, C, dt]
        self.in_proj = QuantLinear(cfg.d_model, in_width, layer_idx=layer_idx, name="mamba.in_proj")
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, k))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim))
        self.A_log = nn.Parameter(torch.empty(self.H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.H, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.H, dtype=torch.float32))
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True
        self.norm = GatedRMSNorm(self.d_inner, self.G, cfg.norm_eps)
        self.out_proj = QuantLinear(self.d_inner, cfg.d_model, layer_idx=layer_idx, name="mamba.out_proj")
        self._init_ssm_params(cfg)

    @torch.no_grad()
    def _init_ssm_params(self, cfg: ModelConfig) -> None:
        if self.A_log.is_meta:  # built on the meta device to count parameters: no values to set
            return
        bound = 1.0 / math.sqrt(cfg.conv_kernel)
        self.conv_weight.uniform_(-bound, bound)
        self.conv_bias.uniform_(-bound, bound)
        lo, hi = cfg.a_init_range
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(lo, hi).log())
        log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(cfg.dt_min), math.log(cfg.dt_max))
        dt = log_dt.exp().clamp(min=cfg.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.D.fill_(1.0)

    def output_projections(self) -> list[QuantLinear]:
        return [self.out_proj]

    def _split(self, zxbcdt: torch.Tensor):
        """[..., 2E + 2GN + H] -> z [..., E], xBC [..., C], dt_raw [..., H]."""
        return zxbcdt.split(self.in_widths, -1)

    def _ssm_inputs(
        self, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt_raw: torch.Tensor, ddt_into=None
    ):
        """The conv output's (after SiLU) x [.., E], B, C [.., G N] and raw dt -> x [.., H, P], B, C
        [.., G, N], dt [.., H] FP32."""
        dt = dt_softplus(dt_raw, self.dt_bias, ddt_into=ddt_into)  # [..., H]
        if self.dt_min_clamp > 0:  # transformers' time_step_limit[0] (no gradient below)
            dt = dt.clamp(min=self.dt_min_clamp)
        return (
            x.unflatten(-1, (self.H, self.P)),
            B.unflatten(-1, (self.G, self.N)),
            C.unflatten(-1, (self.G, self.N)),
            dt,
        )

    def _output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, dz_into=None) -> torch.Tensor:
        """y, x: [..., H, P]; z: [..., E] -> out_proj(norm((y + D x) * silu(z))) [..., D]."""
        # out_proj's input: the skip sum's dtype (FP32, as D is) unless autocast narrows it
        summed = torch.promote_types(torch.promote_types(y.dtype, x.dtype), self.D.dtype)
        norm = self.norm
        h = skip_gated_rms_norm(
            y, x, self.D, z, norm.weight, self.G, norm.eps, output_dtype(summed, y.device), dz_into=dz_into
        )
        return self.out_proj(h)

    def _project_in(self, u: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], list]:
        """u [B, L, D] -> (z, xBC, dt_raw) and where their consumers write their gradients."""
        return self._split_for_grad(self.in_proj(u))  # [B, L, 2E + 2GN + H] split

    def _split_for_grad(self, zxbcdt: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], list]:
        if torch.is_grad_enabled() and zxbcdt.requires_grad and fast_forms_on(zxbcdt):
            parts, slab = split_with_grad_slab(zxbcdt, self.in_widths)
            return parts, [slab.into(i) for i in range(3)]
        return self._split(zxbcdt), [None] * 3

    def _mix(self, u: torch.Tensor, seg: torch.Tensor | None, valid: torch.Tensor | None):
        """The sequence path shared by forward and prefill. u: [B, L, D]; valid: [B, L] bool or None.
        Returns the output [B, L, D], the pre-conv inputs xBC [B, L, C] and the final SSM state."""
        (z, xBC_in, dt_raw), into = self._project_in(u)
        conv = conv_silu_for(self.conv_impl, u, self.conv_weight.shape[1])
        x, B, C = conv(xBC_in, self.conv_weight, self.conv_bias, seg, self.xbc_widths, into[1])
        x, B, C, dt = self._ssm_inputs(x, B, C, dt_raw, into[2])
        if valid is not None:
            dt = dt * valid[..., None]  # padded positions: no decay, no input (the state is untouched)
        A = -torch.exp(self.A_log)  # [H]
        y, final = ssd(x, dt, A, B, C, self.chunk_size, doc_ids=seg, impl=self.ssd_impl)  # y: [B, L, H, P]
        return self._output(y, x, z, into[0]), xBC_in, final

    def forward(self, u: torch.Tensor, packing: Packing | None = None):
        """u: [B, L, D] -> [B, L, D]."""
        out, _, _ = self._mix(u, None if packing is None else packing.seg, None)
        return out

    def allocate_state(self, batch: int, max_len: int, device, dtype) -> MambaState:
        k = self.conv_weight.shape[1]
        on_cuda = torch.device(device).type == "cuda"  # the fused decode kernel's scratch lives there
        return MambaState(
            conv=torch.zeros(batch, self.conv_dim, k - 1, device=device, dtype=dtype),
            ssm=torch.zeros(
                batch, self.H, self.P, self.N, device=device, dtype=torch.promote_types(dtype, torch.float32)
            ),
            done=torch.zeros(batch, self.G + 1, device=device, dtype=torch.int32) if on_cuda else None,
        )

    def prefill(self, u: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """u: [B, L, D] right-padded prompts -> [B, L, D]; stores the conv window and SSM state."""
        state: MambaState = cache.layers[self.layer_idx]
        L = u.shape[1]
        out, xBC_in, final = self._mix(u, None, cache.valid_mask(L))
        # The conv window is the last k-1 *real* inputs: positions lengths-k+1 .. lengths-1 (zeros
        # before position 0), gathered from the zero-prefixed inputs, where position t sits at t+k-1.
        k = self.conv_weight.shape[1]
        xp = F.pad(xBC_in, (0, 0, k - 1, 0))  # [B, k-1+L, C]
        idx = cache.lengths[:, None] + torch.arange(k - 1, device=u.device)[None, :]  # [B, k-1]
        window = xp.gather(1, idx[..., None].expand(-1, -1, self.conv_dim))  # [B, k-1, C]
        state.conv.copy_(window.transpose(1, 2))
        state.ssm.copy_(final)
        return out

    def decode_args(self, zxbcdt: torch.Tensor, state: MambaState) -> tuple:
        """The arguments of one decode step (``mamba2_decode``) after in_proj, to the output dtype."""
        summed = torch.promote_types(zxbcdt.dtype, self.D.dtype)  # the skip sum's dtype, as in _output
        return (
            zxbcdt, state.conv, state.ssm, self.conv_weight, self.conv_bias, self.dt_bias, self.A_log,
            self.D, self.norm.weight, self.G, self.norm.eps, output_dtype(summed, zxbcdt.device),
        )  # fmt: skip

    def step(self, u: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """u: [B, D] one new token per sequence -> [B, D]; advances the conv window and SSM state."""
        return self._step_from(self.in_proj(u), cache.layers[self.layer_idx])

    def _step_from(self, zxbcdt: torch.Tensor, state: MambaState) -> torch.Tensor:
        """The step after in_proj: zxbcdt [B, 2E + 2GN + H] -> [B, D]."""
        args = self.decode_args(zxbcdt, state)
        if fused_decode_applies(zxbcdt, state.conv, state.ssm):
            h = mamba_decode(*args, dt_min_clamp=self.dt_min_clamp, done=state.done)  # [B, E]
        else:
            h = mamba_decode_ref(*args, dt_min_clamp=self.dt_min_clamp)
        return self.out_proj(h)
