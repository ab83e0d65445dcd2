"""The stateful step: the generator and the F0 predictor computing only new frames, every layer's left context
carried as an explicit, named cache (see ``../shared/spec/stateful-step.md`` for the inventory).

A stream is a sequence of steps over consecutive frame ranges. Frame ``t`` of a step is a ``conv_pre`` output frame
(= a mel frame). A **generator step** over frames ``[a, a+c)`` takes

* ``mel [B, 80, c+4]``: mel frames ``[a, a+c+4)`` (the 4 extra are ``conv_pre``'s look-ahead; they are passed again
  as the first 4 frames of the next step, so the graph never computes a frame before the utterance start);
* ``f0 [B, c+1]`` and ``noise [B, 480(c+1), 9]``: frames ``[a, a+c+1)`` (the source STFT frame at the step's right
  edge reads 8 samples of frame ``a+c``; that frame is computed again, identically, by the next step);
* ``phase_in [B, 9]`` float64: the running phase sum at frame ``a-1`` (zeros at the start);
* ``first [B, 1]`` bool: the utterance starts with this step (the two non-zero left edges: the reflection pad after
  the last upsample reads ``x[1]``, the source STFT reflects samples 1..8);
* every cache of :func:`generator_cache_layout` (zeros at the start reproduce every causal zero padding),

and returns ``audio [B, 480c]`` (samples ``[480(a-1), 480(a+c-1))``: the audio lags by one frame, the iSTFT's
overlap; on the first step the first 480 samples precede the utterance and are dropped by the caller),
``phase_out [B, 9]`` (the sum at frame ``a+c-1``) and the updated caches.

The **final step** covers the last frames ``[a, N)``: ``mel [B, 80, c]`` (zero look-ahead, upstream's
``finalize=True``), ``f0 [B, c]``, ``noise [B, 480c, 9]``; the source STFT reflects its last samples, the iSTFT emits
its tail with the partial envelope and the centring trim, and the output is ``audio [B, 480(c+1)]`` (everything not
yet emitted). A step of ``c`` frames has shapes that depend on ``c`` alone.

An **F0 step** over frames ``[k, k+c)`` takes ``mel [B, 80, c+3]`` (frames ``[k, k+c+3)``, look-ahead included;
3 zero frames at the end of the utterance) and the input of each causal layer's last 2 frames, and returns
``f0 [B, c]`` float32 and the updated caches (in the predictor's precision).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import HiFTConfig
from .f0_predictor import CausalF0Predictor, matmul_conv
from .generator import CausalHiFTGenerator
from .layers import CausalConv1d, Conv1d, ResBlock, nearest_upsample
from .spectral_ops import overlap_add

# The step's alignment, beyond the config's look-aheads: a step over frames [a, a+c) reads the source of frame a+c
# (its last STFT frame needs 8 samples of it), and its audio lags by one frame (the iSTFT's overlap).
SOURCE_LOOK_AHEAD_FRAMES = 1
AUDIO_LAG_FRAMES = 1

# Precision inside the F0 step; its inputs and outputs are float32 either way. "fp64" computes like upstream
# (bit-exact F0); "fp32" rounds differently with the input length (stepped F0 then differs from one pass).
F0_PRECISIONS = {"fp64": torch.float64, "fp32": torch.float32}


def step_contract(config: HiFTConfig, f0_dtype: str) -> dict[str, Any]:
    """What a runtime (or any engine) needs to drive the step graphs; written into the manifest."""
    return {
        "mel_look_ahead_frames": config.conv_pre_look_right,
        "source_look_ahead_frames": SOURCE_LOOK_AHEAD_FRAMES,
        "audio_lag_frames": AUDIO_LAG_FRAMES,
        "f0_look_ahead_frames": config.f0_look_ahead,
        "generator_caches": generator_cache_layout(config),
        "f0_caches": f0_cache_layout(config, f0_dtype),
        # The slot form's pool row: every generator cache of one stream, flattened in layout order (float32).
        "pool_row_floats": pool_row_floats(generator_cache_layout(config)),
    }


# ---- cache layout: names, per-stream shapes, dtypes and initial values; written into the manifest -------------------
def _resblock_layout(prefix: str, channels: int, kernel: int, dilations: Sequence[int]) -> list[tuple[str, list[int]]]:
    out = []
    for j, d in enumerate(dilations):
        out.append((f"{prefix}.{j}.conv1", [channels, (kernel - 1) * d]))
        out.append((f"{prefix}.{j}.conv2", [channels, kernel - 1]))
    return out


def generator_cache_layout(config: HiFTConfig) -> list[dict[str, Any]]:
    """Every cache of the generator step, in graph order: ``{name, shape (per stream), dtype, init}``.

    ``init`` is ``"zeros"`` for all of them: the utterance start is the ``first`` input, not a cache value.
    """
    c = config
    entries: list[tuple[str, list[int], str]] = []
    channels_in = c.base_channels
    downs = c.source_down_rates
    bins2 = 2 * c.stft_bins
    for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)):
        entries.append((f"ups.{i}", [channels_in, k - 1], "float32"))
        if downs[i] > 1:
            entries.append((f"source_downs.{i}", [bins2, downs[i] - 1], "float32"))
        for name, shape in _resblock_layout(f"source_resblocks.{i}", c.channels(i), c.source_resblock_kernel_sizes[i],
                                            c.source_resblock_dilation_sizes[i]):
            entries.append((name, shape, "float32"))
        for j, (kr, dr) in enumerate(zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes)):
            for name, shape in _resblock_layout(f"resblocks.{i * len(c.resblock_kernel_sizes) + j}", c.channels(i),
                                                kr, dr):
                entries.append((name, shape, "float32"))
        channels_in = c.channels(i)
    last = c.channels(len(c.upsample_rates) - 1)
    entries += [
        ("reflect", [last, 1], "float32"),  # the one-sample delay of ReflectionPad1d((1, 0))
        ("source", [1, c.n_fft // 2], "float32"),  # source samples before the step (the STFT's left context)
        ("conv_post", [last, 6], "float32"),
        ("istft_tail", [1, c.n_fft - c.hop_len], "float32"),  # overlap-add partial sums past the step
        ("audio_delay", [1, AUDIO_LAG_FRAMES * c.samples_per_frame - c.n_fft // 2], "float32"),  # finished, not yet emitted (1 frame lag)
    ]
    return [{"name": n, "shape": s, "dtype": d, "init": "zeros"} for n, s, d in entries]


def pool_row_floats(layout: Sequence[dict[str, Any]]) -> int:
    """Floats of one stream's caches of ``layout``: one row of the slot form's pool (``hift_export/slots.py``)."""
    return int(sum(math.prod(e["shape"]) for e in layout))


def f0_cache_layout(config: HiFTConfig, dtype: str) -> list[dict[str, Any]]:
    """Caches of the F0 step: the last ``k-1`` input frames of each causal conv, in the predictor's precision."""
    return [{"name": f"f0.condnet.{2 * i}", "shape": [config.f0_cond_channels, config.f0_kernel - 1], "dtype": dtype,
             "init": "zeros"} for i in range(1, config.f0_num_layers)]


# ---- the eager step ----------------------------------------------------------------------------------------------------
def _tail(x: torch.Tensor, size: int, shift: torch.Tensor | None = None, skip: int = 0) -> torch.Tensor:
    """``x[..., -size-skip:-skip]``: the ``size`` samples before the last ``skip``; with ``shift [B, 1, 1]`` (a step in
    a window) each row's end ``shift`` samples earlier (its own last real sample)."""
    if shift is None:
        return x[..., -size - skip: -skip if skip else None]
    index = x.shape[-1] - skip - size - shift + torch.arange(size, device=x.device)
    return torch.gather(x, -1, index.expand(x.shape[0], x.shape[1], size))


def _cached_conv(conv: Conv1d, x: torch.Tensor, cache: torch.Tensor, shift: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal conv continued from its left context: ``conv(cat(cache, x))`` without padding, and the new cache
    (``shift``: see :func:`_tail`)."""
    full = torch.cat([cache, x], dim=-1)
    return conv.convolve(full), _tail(full, cache.shape[-1], shift)


def _resblock_step(block: ResBlock, x: torch.Tensor, prefix: str, caches: dict[str, torch.Tensor],
                   new: dict[str, torch.Tensor], shift: torch.Tensor | None = None) -> torch.Tensor:
    for j, (conv1, conv2, act1, act2) in enumerate(zip(block.convs1, block.convs2, block.activations1,
                                                       block.activations2)):
        h, new[f"{prefix}.{j}.conv1"] = _cached_conv(conv1, act1(x), caches[f"{prefix}.{j}.conv1"], shift)
        h, new[f"{prefix}.{j}.conv2"] = _cached_conv(conv2, act2(h), caches[f"{prefix}.{j}.conv2"], shift)
        x = h + x
    return x


def _trunk(gen: CausalHiFTGenerator, mel: torch.Tensor, s_stft: torch.Tensor, first3: torch.Tensor,
           caches: dict[str, torch.Tensor], new: dict[str, torch.Tensor], final: bool,
           short: torch.Tensor | None = None) -> torch.Tensor:
    """The convolution trunk of a generator step: ``conv_pre``, the upsampling stages with their source branches and
    resblocks, ``conv_post``; writes its caches into ``new``. ``short [B, 1, 1]``: a stream step in a window, each
    row's frames short of the window's (its caches are taken that many frames before the end, at each stage's rate)."""
    cfg = gen.config
    x = gen.conv_pre(mel, pad_right=final)
    last = len(gen.ups) - 1
    downs = cfg.source_down_rates
    rate = 1  # samples per frame at the current stage
    for i, up in enumerate(gen.ups):
        rate *= up.upsample_factor
        shift = None if short is None else short * rate
        x = F.leaky_relu(x, cfg.lrelu_slope)
        x, new[f"ups.{i}"] = _cached_conv(up, nearest_upsample(x, up.upsample_factor), caches[f"ups.{i}"], shift)
        if i == last:
            delayed = torch.where(first3, x[..., 1:2], caches["reflect"])
            new["reflect"] = _tail(x, 1, shift)
            x = torch.cat([delayed, x if final else x[..., :-1]], dim=-1)
        down = gen.source_downs[i]
        if downs[i] > 1:
            key = f"source_downs.{i}"
            full = torch.cat([caches[key], s_stft], dim=-1)
            si = down.convolve(full)
            new[key] = _tail(full, caches[key].shape[-1], None if short is None else short * (rate * downs[i]),
                             skip=1)
        else:
            si = down(s_stft if final else s_stft[..., :-1])
        si = _resblock_step(gen.source_resblocks[i], si, f"source_resblocks.{i}", caches, new, shift)
        x = x + si
        xs = None
        for j in range(gen.num_kernels):
            k = i * gen.num_kernels + j
            out = _resblock_step(gen.resblocks[k], x, f"resblocks.{k}", caches, new, shift)
            xs = out if xs is None else xs + out
        x = xs / gen.num_kernels
    x = F.leaky_relu(x, cfg.post_lrelu_slope)
    x, new["conv_post"] = _cached_conv(gen.conv_post, x, caches["conv_post"], shift)
    return x


def generator_step(gen: CausalHiFTGenerator, mel: torch.Tensor, f0: torch.Tensor, noise: torch.Tensor,
                   phase_in: torch.Tensor, first: torch.Tensor, caches: dict[str, torch.Tensor],
                   final: bool, trunk_dtype: torch.dtype | None = None,
                   source: tuple[torch.Tensor, torch.Tensor] | None = None, frames: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One generator step (see the module docstring). Returns ``(audio, phase_out, new caches)``; the final step
    returns no caches.

    ``trunk_dtype`` (e.g. ``torch.float16``): the convolution trunk (``conv_pre`` .. ``conv_post``, the source
    resblocks included) under autocast to that dtype; the source, its STFT, the phase and the iSTFT head stay float32,
    and the trunk's output is made finite before the head (an overflow in half precision must not become NaN audio).
    The caches the trunk writes are then in that dtype.

    ``source``: ``gen.m_source(f0, noise, phase_in)`` computed by the caller (``f0`` and ``noise`` are then unused):
    a compiler can take the rest of the step while the source's phase rounds as eager code rounds it.

    ``frames [B]``: a step in a fixed *window* of ``c`` frames, each row's step only ``frames`` of them long (what
    lies past them, inputs and outputs, is padding: zeros in, discarded out). One graph then serves every step of up
    to ``c`` frames. A row's outputs equal a step of ``frames`` frames: for the final step its first
    ``480(frames+1)`` samples (the end's reflection, the iSTFT's last frames and its envelope follow each row's end;
    ``phase_out`` is the window's, unused); for a stream step its first ``480 frames`` samples, its ``phase_out``
    and its caches (each taken at the row's own end, at its stage's rate: the window's padding only ever follows the
    real frames, and every layer is causal)."""
    if gen.spectral.mode != "conv":
        raise ValueError("the step form needs the generator built with spectral='conv'")
    cfg = gen.config
    new: dict[str, torch.Tensor] = {}
    first3 = first.reshape(-1, 1, 1)
    half = cfg.n_fft // 2

    # Source: frames [a, a+c+1) (stream) or [a, N) (final); the STFT frames [120a, 120(a+c)] from it.
    source, cum = gen.m_source(f0, noise, phase_in) if source is None else source
    phase_out = cum[:, -1] if final else cum[:, -2]
    spf = cfg.samples_per_frame
    short = shift = None  # a stream step in a window: each row's frames short of the window's, [B, 1, 1]; samples
    if frames is not None and not final:
        # (a CUDA graph's padding rows carry frames 0: clamped, their gathers stay inside the tensors, where an index
        # out of bounds is undefined on a GPU; a real row's frames are already in [1, c])
        frames = frames.clamp(1, mel.shape[-1] - cfg.conv_pre_look_right)
        short = (mel.shape[-1] - cfg.conv_pre_look_right - frames).reshape(-1, 1, 1)
        shift = short * spf
        phase_out = torch.gather(cum, 1, (frames - 1).reshape(-1, 1, 1).expand(-1, 1, cum.shape[-1]))[:, 0]
    # Every slice below is relative to an end with a constant offset, so each shape is affine in c (no data-dependent
    # sizes for torch.export). In a window (short) the ends that carry state are each row's own (_tail).
    head = torch.where(first3, torch.flip(source[..., 1:half + 1], dims=[-1]), caches["source"])
    if final and frames is not None:
        src = _reflected_at(torch.cat([head, source], dim=-1), half + frames * spf, half)
    elif final:
        src = torch.cat([head, source, torch.flip(source[..., -half - 1:-1], dims=[-1])], dim=-1)
    else:
        src = torch.cat([head, source[..., : half - spf]], dim=-1)  # up to 8 samples into frame a+c
        new["source"] = _tail(source, half, shift, skip=spf)
    s_stft = F.conv1d(src, gen.spectral.stft_kernel, stride=cfg.hop_len)  # 120c + 1 frames

    if trunk_dtype is None:
        x = _trunk(gen, mel, s_stft, first3, caches, new, final, short)
    else:
        with torch.autocast(mel.device.type, dtype=trunk_dtype):
            x = _trunk(gen, mel, s_stft, first3, caches, new, final, short)
        limit = torch.finfo(trunk_dtype).max
        x = torch.nan_to_num(x.float(), nan=0.0, posinf=limit, neginf=-limit)

    # iSTFT: overlap-add of this step's frames, plus the carried partial sums; the envelope (sum of squared windows)
    # is that of the frames that exist: none before the utterance start, none past its end.
    bins = cfg.stft_bins
    magnitude = torch.clip(torch.exp(x[:, :bins, :]), max=1e2)
    phase = torch.sin(x[:, bins:, :])
    spectrum = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
    exists_here = torch.ones_like(x[:, :1, :])
    if frames is not None:  # a window: the STFT frames past a row's end do not exist (no sound, no envelope)
        stft_frames = frames.reshape(-1, 1, 1) * (spf // cfg.hop_len) + (1 if final else 0)
        exists_here = (torch.arange(x.shape[-1], device=x.device) < stft_frames).to(x.dtype)
        spectrum = torch.where(exists_here > 0, spectrum, 0.0)  # not a product: 0 * inf of a row's garbage is NaN
    y = overlap_add(F.conv1d(spectrum, gen.spectral.istft_taps), cfg.hop_len)  # [B, 1, 4F + 12]
    overlap = cfg.n_fft - cfg.hop_len
    y = torch.cat([y[..., :overlap] + caches["istft_tail"], y[..., overlap:]], dim=-1)
    before = overlap // cfg.hop_len  # frames before this step that still reach its samples (3)
    exists = torch.cat([torch.where(first3, 0.0, 1.0).expand(-1, 1, before), exists_here], dim=-1)
    envelope = overlap_add(exists * gen.spectral.window_sq_taps, cfg.hop_len)[..., overlap:]
    # The envelope is 0 only at the utterance's very first sample (where y is 0 too), inside the centring trim: a
    # floor there keeps 0/0 out of the discarded samples and changes no other value (the next smallest is 1.4e-3).
    envelope = torch.clamp(envelope, min=1e-11)
    if final:
        done = y[..., :-half] / envelope[..., :-half]  # the centring trim at the end
    else:
        done = y[..., :-overlap] / envelope[..., :-overlap]
        new["istft_tail"] = _tail(y, overlap, shift)
    delay = caches["audio_delay"].shape[-1]
    audio = torch.cat([caches["audio_delay"], done], dim=-1)
    if not final:
        new["audio_delay"] = _tail(audio, delay, shift)
        audio = audio[..., :-delay]
    audio = torch.clamp(audio[:, 0, :], -cfg.audio_limit, cfg.audio_limit)
    return audio, phase_out, ({} if final else new)


def _reflected_at(signal: torch.Tensor, end: torch.Tensor, pad: int) -> torch.Tensor:
    """``signal [B, 1, L]`` extended by ``pad`` samples, each row reflected at its own ``end [B]`` (exclusive, as
    ``flip(x[..., end-pad-1:end-1])`` after ``x[..., :end]``); what lies past the reflection is unspecified (unused)."""
    length = signal.shape[-1] + pad
    j = torch.arange(length, device=signal.device).expand(signal.shape[0], 1, length)
    end = end.reshape(-1, 1, 1)
    index = torch.where(j < end, j, 2 * end - 2 - j).clamp(0, signal.shape[-1] - 1)
    return torch.gather(signal, -1, index)


def f0_step(predictor: CausalF0Predictor, mel: torch.Tensor, caches: dict[str, torch.Tensor],
            one_gemm: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One F0 step: ``mel [B, 80, c+3]`` -> ``f0 [B, c]`` float32 and the new caches (see the module docstring).

    ``one_gemm`` (the ``matmul`` form only): each convolution as one GEMM over the whole batch's frames instead of B
    skinny ones (``c + 2`` columns each): the same products and sums per output, far fewer kernel launches on a GPU.
    The exported graph keeps the batched form (ONNX Runtime's choice)."""
    x = mel.to(predictor.classifier.weight.dtype)
    new: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(predictor.condnet):
        if isinstance(layer, CausalConv1d):
            if i > 0:
                key = f"f0.condnet.{i}"
                x = torch.cat([caches[key], x], dim=-1)
                new[key] = x[..., -caches[key].shape[-1]:]
            if predictor.impl == "torch":
                x = F.conv1d(x, layer.weight, layer.bias, dilation=layer.dilation)
            else:
                x = _one_gemm_conv(layer, x) if one_gemm else matmul_conv(layer, x)
        elif predictor.impl == "torch":
            x = layer(x)
        else:  # ELU(alpha=1), as the float64 graph computes it
            x = torch.where(x > 0, x, torch.exp(x) - 1)
    if predictor.impl == "torch":
        f0 = torch.abs(predictor.classifier(x.transpose(1, 2)).squeeze(-1))
    else:
        # ``W @ x`` rather than ``Linear(x^T)``: ONNX Runtime fuses a Transpose feeding a MatMul into
        # com.microsoft.FusedMatMul, which has no float64 kernel before ORT 1.26 (the graph would not load there).
        weight, bias = predictor.classifier.weight, predictor.classifier.bias
        f0 = torch.abs((torch.matmul(weight, x) + bias.unsqueeze(-1)).squeeze(1))
    return f0.to(torch.float32), new


def _one_gemm_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """:func:`matmul_conv` as one ``[Co, K*Ci] @ [K*Ci, B*T]`` GEMM (the batch folded into the columns)."""
    k, d = conv.kernel_size[0], conv.dilation[0]
    steps = x.shape[2] - (k - 1) * d
    taps = torch.cat([x[:, :, j * d: j * d + steps] for j in range(k)], dim=1)  # [B, K*Ci, T]
    weight = conv.weight.permute(0, 2, 1).reshape(conv.out_channels, k * conv.in_channels)
    columns = taps.transpose(0, 1).reshape(k * conv.in_channels, -1)
    out = torch.matmul(weight, columns).reshape(conv.out_channels, x.shape[0], steps).transpose(0, 1)
    return out + conv.bias.unsqueeze(-1)


DTYPES = {"float32": torch.float32, "float64": torch.float64}  # the manifest's dtype names (NumPy's)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float64`` -> ``"float64"``, as the manifest spells it."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def zero_caches(layout: Sequence[dict[str, Any]], batch: int, device: Any = "cpu") -> dict[str, torch.Tensor]:
    return {e["name"]: torch.zeros(batch, *e["shape"], dtype=DTYPES[e["dtype"]], device=device) for e in layout}
