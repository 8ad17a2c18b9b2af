"""``run_generate``: greedy generation with prefill/decode timing, in ZeRO-Inference's style.

Reports tokens/s for the prefill (the prompt's forward pass, producing the first token), the
decode (every later token) and the whole, bytes read, peak RSS and the overlap efficiency
(share of wall time the model thread was not stalled waiting for weights).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from .._deprecation import renamed_keywords
from ..config import IOConfig
from ..io.volume import Volume
from ._metrics import RssSampler, disk_read_bytes
from ._quant import resolve_setting

__all__ = ["GenerateResult", "GenerateTiming", "time_generate", "run_generate"]


@dataclasses.dataclass(frozen=True)
class GenerateTiming:
    """Wall seconds of one greedy ``generate`` call and the tokens it produced."""

    prefill_seconds: float
    decode_seconds: float
    tokens: torch.Tensor  # (batch, gen_len) new token ids

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


class _Clock:
    """A transformers streamer that notes when the prompt and the first new token arrive."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _model_device(model: nn.Module) -> torch.device:
    hf: Any = model  # a transformers model: its methods are not nn.Module's
    emb = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    return emb.weight.device if emb is not None else next(model.parameters()).device


def time_generate(model: nn.Module, *, batch_size: int, prompt_len: int, gen_len: int,
                  seed: int = 0) -> GenerateTiming:
    """Greedy-generate exactly ``gen_len`` tokens for a random prompt; blocking."""
    if min(batch_size, prompt_len, gen_len) < 1:
        raise ValueError("batch_size, prompt_len and gen_len must be >= 1")
    device = _model_device(model)
    hf: Any = model  # a transformers model: its config and generate() are not nn.Module's
    vocab = int(hf.config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=gen).to(device)
    clock = _Clock(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=gen_len, min_new_tokens=gen_len, streamer=clock,
                             pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
    first = clock.stamps[1] if len(clock.stamps) > 1 else t1
    return GenerateTiming(first - t0, t1 - first, out[:, prompt_len:].cpu())


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """One ``run_generate`` measurement; rates in tokens/s summed over the batch, 1 GB = 1e9 B."""

    mode: str
    batch_size: int
    prompt_len: int
    gen_len: int
    prefetch: int
    device: str
    dtype: str
    load_seconds: float
    prefill_seconds: float
    decode_seconds: float
    bytes_read: int        # weight bytes the streamer read (0 in memory mode)
    disk_read_bytes: int   # bytes this process read from storage during generate (/proc/self/io)
    stall_seconds: float   # time blocked waiting for weights
    peak_rss_anon: int
    peak_rss_file: int
    tokens: tuple[tuple[int, ...], ...]
    quantize: str | None = None     # "int8"/"int4" when block weights were stored quantised
    group_size: int | None = None
    dequant_seconds: float = 0.0    # host time dequantising (part of compute, not of stall)

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch_size * self.prompt_len / self.prefill_seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size * max(self.gen_len - 1, 0) / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        """Generated tokens per second of the whole call (prefill included)."""
        return self.batch_size * self.gen_len / self.total_seconds

    @property
    def overlap_efficiency(self) -> float:
        """Compute time / wall time: 1.0 when I/O never stalled the model."""
        return max(0.0, 1.0 - self.stall_seconds / self.total_seconds)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("tokens")
        for k in ("total_seconds", "prefill_tokens_per_s", "decode_tokens_per_s",
                  "total_tokens_per_s", "overlap_efficiency"):
            d[k] = getattr(self, k)
        return d

    def render(self) -> str:
        mb = 1e6
        return "\n".join([
            f"deepnvme generate: mode {self.mode}, batch {self.batch_size}, prompt {self.prompt_len}, "
            f"gen {self.gen_len}, prefetch {self.prefetch}, {self.device}, {self.dtype}"
            + (f", weights {self.quantize} (group {self.group_size})" if self.quantize else ""),
            f"  load            {self.load_seconds:8.2f} s",
            f"  prefill         {self.prefill_seconds:8.2f} s  {self.prefill_tokens_per_s:10.1f} tokens/s",
            f"  decode          {self.decode_seconds:8.2f} s  {self.decode_tokens_per_s:10.2f} tokens/s",
            f"  total           {self.total_seconds:8.2f} s  {self.total_tokens_per_s:10.2f} tokens/s",
            f"  weights read    {self.bytes_read / 1e9:8.3f} GB (disk reads {self.disk_read_bytes / 1e9:.3f} GB)",
            f"  overlap         {self.overlap_efficiency:8.1%}  (stalled {self.stall_seconds:.2f} s"
            + (f", dequantising {self.dequant_seconds:.2f} s)" if self.quantize else ")"),
            f"  peak RSS        {self.peak_rss_anon / mb:8.1f} MB anonymous, "
            f"{self.peak_rss_file / mb:.1f} MB file-backed",
        ])


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@renamed_keywords(offload_dir="packed_dir")
def run_generate(model_dir: str, *, packed_dir: str | Volume | None = None, mode: str = "deepnvme",
                 batch_size: int = 1, prompt_len: int = 32, gen_len: int = 16, prefetch: int = 1,
                 device: str = "cpu", dtype: str | torch.dtype | None = None,
                 pin_memory: bool = True, config: IOConfig | None = None,
                 seed: int = 0, quantize: str | None = None, group_size: int | None = None) -> GenerateResult:
    """Load the model in ``model_dir`` (``mode="deepnvme"``: streamed with :func:`load_streamed`,
    from an aligned copy in ``packed_dir`` if given, stored ``quantize``d with ``group_size`` if
    given; ``"memory"``: fully in memory) and time one greedy generation."""
    from .install import stream_stats, streamer_of
    from .pretrained import load_streamed

    torch_dtype = parse_dtype(dtype)
    setting = resolve_setting(quantize, group_size)
    if mode == "memory" and quantize is not None:
        raise ValueError("quantize applies to streamed weights (mode='deepnvme'), not to mode='memory'")
    import transformers  # noqa: F401  (imported before timing: load_seconds is loading, not importing)

    with RssSampler() as rss:
        t0 = time.perf_counter()
        if mode == "deepnvme":
            model = load_streamed(model_dir, packed_dir=packed_dir, device=device, dtype=torch_dtype,
                                  prefetch=prefetch, pin_memory=pin_memory, config=config,
                                  quantize=quantize, group_size=group_size)
        elif mode == "memory":
            from transformers import AutoModelForCausalLM
            auto: Any = AutoModelForCausalLM  # its stubs type from_pretrained's first argument oddly
            model = auto.from_pretrained(model_dir, dtype=torch_dtype or "auto").to(device).eval()
        else:
            raise ValueError(f"mode must be 'deepnvme' or 'memory', got {mode!r}")
        load = time.perf_counter() - t0
        if mode == "deepnvme":
            streamer_of(model).reset_stats()
        disk0 = disk_read_bytes()
        try:
            timing = time_generate(model, batch_size=batch_size, prompt_len=prompt_len,
                                   gen_len=gen_len, seed=seed)
        except BaseException:
            if mode == "deepnvme":  # free its I/O threads and pinned buffers now, not at GC
                streamer_of(model).close()
            raise
        disk = disk_read_bytes() - disk0
    stats = stream_stats(model) if mode == "deepnvme" else None
    param_dtype = next(model.parameters()).dtype
    if stats is not None:
        streamer_of(model).close()
    return GenerateResult(
        mode=mode, batch_size=batch_size, prompt_len=prompt_len, gen_len=gen_len,
        prefetch=prefetch if mode == "deepnvme" else 0, device=str(device),
        dtype=str(param_dtype).replace("torch.", ""), load_seconds=load,
        prefill_seconds=timing.prefill_seconds, decode_seconds=timing.decode_seconds,
        bytes_read=stats.bytes_read if stats else 0, disk_read_bytes=disk,
        stall_seconds=stats.stall_seconds if stats else 0.0,
        peak_rss_anon=rss.peak_anon, peak_rss_file=rss.peak_file,
        tokens=tuple(tuple(int(t) for t in row) for row in timing.tokens),
        quantize=quantize, group_size=setting.group_size if setting else None,
        dequant_seconds=stats.dequant_seconds if stats else 0.0)
