"""The Triton attention backend against the torch backend (the oracle) on random pools and page tables.

On the CPU the kernels run in Triton's interpreter at small shapes; MINISGL_TEST_DEVICE=cuda runs the same
tests compiled, at bigger shapes and in bf16 too, plus a CUDA-graph replay of decode. An fp8 pool runs the
same cases: the oracle is the torch backend over the same fp8 pool.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from helpers import DEVICE, hf_greedy, make_llm, random_prompts

from minisgl import SamplingParams
from minisgl.attention import make_backend
from minisgl.attention.base import ForwardInput
from minisgl.attention.torch_backend import TorchBackend
from minisgl.attention.triton_backend import DecodeMeta, ExtendMeta, MixedMeta, StaticStepMeta, TritonBackend
from minisgl.kernels import attention as kernels
from minisgl.kernels.attention import KernelConfig, num_decode_splits
from minisgl.kvcache.pool import KVPool

ON_GPU = DEVICE == "cuda"
LAYER = 1  # of 2: the kernels must see the layer's own slice of the pool
# (heads, kv_heads): MHA, GQA 2, 3 (a group that is no power of two) and 4.
HEAD_CONFIGS = [(4, 4), (4, 2), (6, 2), (8, 2)]
HEAD_DIMS = [64, 128] if ON_GPU else [16, 64]
# Small tiles make the CPU shapes cross several query tiles and key blocks; the defaults run on the GPU.
SMALL = KernelConfig(decode_block_n=16, extend_block_m=32, extend_block_n=16)
CONFIGS = {"small": SMALL, "default": KernelConfig()}
TOLERANCE = {torch.float32: 2e-5 if not ON_GPU else 1e-4, torch.bfloat16: 2e-2}
FP8 = torch.float8_e4m3fn


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """x as bytes: exact equality for any type (torch has no fp8 comparisons). fp8's -0 reads as +0: the GPU's
    store writes a negative value that rounds to zero as +0, the same number."""
    raw = x.view(torch.uint8)
    return raw.masked_fill(raw == 0x80, 0) if x.dtype == FP8 else raw


class Case:
    """A pool of random K/V (stale values everywhere, so reading a wrong slot shows), a page table whose
    rows own randomly chosen pages, and one batch of new tokens with their q/k/v."""

    def __init__(self, kv_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype = torch.float32, padded: int = 0, seed: int = 0,
                 cache_dtype: torch.dtype | None = None):
        gen = torch.Generator().manual_seed(seed)
        needs = [-(-(k + n) // page_size) for k, n in zip(kv_lens, extend_lens)]
        num_pages = sum(needs) + 16  # some pages belong to nobody
        self.pool = KVPool(2, num_pages, page_size, kv_heads, head_dim, dtype, torch.device(DEVICE), cache_dtype)
        self.pool.k.copy_(torch.randn(self.pool.k.shape, generator=gen))
        self.pool.v.copy_(torch.randn(self.pool.v.shape, generator=gen))
        num_reqs = len(kv_lens)
        page_table = torch.randint(0, num_pages, (num_reqs + 3, max(needs) + 1), generator=gen, dtype=torch.int32)
        pages = torch.randperm(num_pages, generator=gen).int().tolist()
        rows = torch.randperm(num_reqs + 2, generator=gen)[:num_reqs].tolist()
        for row, need in zip(rows, needs):
            page_table[row, :need] = torch.tensor([pages.pop() for _ in range(need)], dtype=torch.int32)
        # CUDA-graph padding: entries that share one row of scratch pages, kv_len 0, one new token.
        pad_row = num_reqs + 2
        page_table[pad_row] = self.pool.scratch_page
        rows += [pad_row] * padded
        kv_lens, extend_lens = kv_lens + [0] * padded, extend_lens + [1] * padded
        self.page_table = page_table.to(DEVICE)
        self.num_real = sum(extend_lens) - padded

        kv, ext = torch.tensor(kv_lens), torch.tensor(extend_lens)
        decodes = next((i for i, n in enumerate(extend_lens) if n != 1), len(extend_lens))  # leading 1-token rows
        owner = torch.repeat_interleave(torch.arange(len(kv_lens)), ext)
        starts = torch.cumsum(ext, 0) - ext
        tokens = int(ext.sum())
        positions = kv[owner] + torch.arange(tokens) - starts[owner]
        slots = page_table[torch.tensor(rows)[owner], positions // page_size].long() * page_size + positions % page_size
        to_dev = lambda t: t.to(DEVICE)  # noqa: E731
        self.batch = ForwardInput(
            input_ids=to_dev(torch.zeros(tokens, dtype=torch.int64)), positions=to_dev(positions),
            out_slots=to_dev(slots), rows=to_dev(torch.tensor(rows)), kv_lens=to_dev(kv), extend_lens=to_dev(ext),
            seq_lens=to_dev(kv + ext), last_index=to_dev(starts + ext - 1), max_extend=max(extend_lens),
            max_seq_len=max(k + n for k, n in zip(kv_lens, extend_lens)), is_decode=max(extend_lens) == 1,
            decode_rows=decodes, decode_kv_tokens=sum(kv_lens[:decodes]))
        self.q, self.k, self.v = (torch.randn(tokens, h, head_dim, generator=gen).to(DEVICE, dtype)
                                  for h in (heads, kv_heads, kv_heads))

    def run(self, backend_cls, config: KernelConfig | None = None, **options) -> tuple[torch.Tensor, KVPool]:
        """Output of one layer's attention, and the pool it read (each backend gets its own copy), into which the
        new K/V were stored first, as the model's rope does (tests/kernels/test_rope_store.py: the kernel)."""
        pool = copy.copy(self.pool)
        pool.k, pool.v = self.pool.k.clone(), self.pool.v.clone()
        pool.store(LAYER, self.batch.out_slots, self.k, self.v)
        backend = backend_cls(pool, self.page_table, **({} if config is None else {"config": config}), **options)
        return backend.attend(LAYER, self.q, backend.prepare(self.batch)), pool

    def check(self, config: KernelConfig | None = None, **options) -> None:
        """The Triton backend (made with `options`) against the torch backend: the output, and the pool left as
        it was."""
        expected, ref_pool = self.run(TorchBackend)
        got, pool = self.run(TritonBackend, config, **options)
        assert got.shape == expected.shape and got.dtype == self.q.dtype
        tol = TOLERANCE[self.q.dtype]
        real = slice(0, self.num_real)
        torch.testing.assert_close(got[real].float(), expected[real].float(), atol=tol, rtol=tol)
        assert torch.isfinite(got).all()  # padded entries are discarded by the engine, but must not be NaN
        owned = slice(0, pool.scratch_page * pool.page_size)  # padding rows' K/V collide on the scratch page
        assert torch.equal(as_bytes(pool.k[:, owned]), as_bytes(ref_pool.k[:, owned]))
        assert torch.equal(as_bytes(pool.v[:, owned]), as_bytes(ref_pool.v[:, owned]))


# Ragged: pure prefill, extend after a partial page, after exactly one page, after several pages, and
# decode-like rows (one new token) in the same batch.
RAGGED_KV = [0, 5, 16, 37, 40, 0]
RAGGED_EXT = [33, 20, 3, 1, 9, 1]
if ON_GPU:
    RAGGED_KV, RAGGED_EXT = RAGGED_KV + [900, 0, 1500], RAGGED_EXT + [300, 700, 1]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", HEAD_CONFIGS)
def test_extend_matches_torch(heads, kv_heads, page_size, config):
    Case(RAGGED_KV, RAGGED_EXT, heads, kv_heads, HEAD_DIMS[0], page_size).check(CONFIGS[config])


@pytest.mark.parametrize("head_dim", HEAD_DIMS[1:] + [24])  # 24: not a power of two, masked
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_head_dims(head_dim, page_size):
    Case(RAGGED_KV, RAGGED_EXT, 4, 2, head_dim, page_size, seed=1).check(SMALL)


DECODE_KV = [0, 15, 16, 17, 70, 3] + ([4000, 1100, 2047] if ON_GPU else [])


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", HEAD_CONFIGS)
def test_decode_matches_torch(heads, kv_heads, page_size, splits):
    """Several splits, including more splits than a short sequence has key blocks (empty splits)."""
    case = Case(DECODE_KV, [1] * len(DECODE_KV), heads, kv_heads, HEAD_DIMS[0], page_size, padded=2, seed=2)
    case.check(KernelConfig(decode_block_n=16, decode_splits=splits))


def test_decode_layers_of_a_step_share_the_split_counters():
    """The last split to arrive reduces and resets its (request, KV head) counter to zero: each layer of a step
    (one metadata, one scratch) gives the torch reference's output, and the counters end as zeros."""
    case = Case(DECODE_KV, [1] * len(DECODE_KV), 6, 2, HEAD_DIMS[0], 1, padded=2, seed=4)
    pool = case.pool
    for layer in (0, 1):
        pool.store(layer, case.batch.out_slots, case.k, case.v)
    triton_backend = TritonBackend(pool, case.page_table, KernelConfig(decode_block_n=16, decode_splits=4))
    torch_backend = TorchBackend(pool, case.page_table)
    meta, torch_meta = triton_backend.prepare(case.batch), torch_backend.prepare(case.batch)
    for layer in (0, 1, 0):
        got = triton_backend.attend(layer, case.q, meta)[: case.num_real]
        want = torch_backend.attend(layer, case.q, torch_meta)[: case.num_real]
        torch.testing.assert_close(got, want, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    assert meta.scratch is not None and not meta.scratch[2].any()


@pytest.mark.parametrize("head_dim", HEAD_DIMS[1:] + [24])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_head_dims(head_dim, page_size):
    case = Case(DECODE_KV, [1] * len(DECODE_KV), 8, 2, head_dim, page_size, seed=3)
    case.check(KernelConfig(decode_block_n=16, decode_splits=4))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_fp8_pool_matches_torch_over_the_same_pool(heads, kv_heads, page_size):
    """An fp8 pool: the kernels load fp8 and upcast in registers, the torch reference dequantizes the gathered
    pages; both read the same stored values (the new tokens' included), so they agree as closely as in fp32."""
    Case(RAGGED_KV, RAGGED_EXT, heads, kv_heads, HEAD_DIMS[0], page_size, seed=13, cache_dtype=FP8).check(SMALL)
    case = Case(DECODE_KV, [1] * len(DECODE_KV), heads, kv_heads, HEAD_DIMS[0], page_size, padded=2, seed=14,
                cache_dtype=FP8)
    case.check(KernelConfig(decode_block_n=16, decode_splits=4))
    case.check()  # the backend's own tiles and splits


@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_pool_under_a_bf16_model_matches_torch(page_size):
    """A 16-bit model over an fp8 pool (the kernels' fp16 dots: e4m3 and bf16 q widened to fp16) against the
    torch reference in bf16, in decode, prefill and extend: they agree to bf16's tolerance."""
    Case(RAGGED_KV, RAGGED_EXT, 6, 2, HEAD_DIMS[0], page_size, dtype=torch.bfloat16, seed=15,
         cache_dtype=FP8).check(SMALL)
    Case(DECODE_KV, [1] * len(DECODE_KV), 6, 2, HEAD_DIMS[0], page_size, dtype=torch.bfloat16, padded=2, seed=16,
         cache_dtype=FP8).check(KernelConfig(decode_block_n=16, decode_splits=4))


# A mixed step as the scheduler builds it: decodes first (different context lengths, one with none cached yet),
# then two prefill chunks, the second after a cached prefix.
MIXED_KV = [30, 7, 64, 0, 0, 21] if not ON_GPU else [900, 4000, 17, 2047, 1100, 0, 1500]
MIXED_EXT = [1, 1, 1, 1, 25, 14] if not ON_GPU else [1, 1, 1, 1, 1, 700, 300]
SPLIT_ALWAYS, SPLIT_NEVER = {"mixed_split_kv_bytes": 0}, {"mixed_split_kv_bytes": 1 << 62}


def mixed_meta_kind(case: Case, **options) -> tuple[type, int]:
    """The metadata class TritonBackend.prepare gives the case's batch, and how many rows its decode part has."""
    meta = TritonBackend(case.pool, case.page_table, **options).prepare(case.batch)
    return type(meta), meta.decode.rows.numel() if isinstance(meta, MixedMeta) else 0


@pytest.mark.parametrize("split", ["always", "never"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 2)])
def test_mixed_batch_matches_torch_through_both_paths(heads, kv_heads, page_size, split):
    """The decode rows of a mixed batch through the split-KV decode kernel and the chunks through the extend
    kernel (re-based to their own rows), or all through the extend kernel: both give the torch reference."""
    options = SPLIT_ALWAYS if split == "always" else SPLIT_NEVER
    case = Case(MIXED_KV, MIXED_EXT, heads, kv_heads, HEAD_DIMS[0], page_size, seed=20)
    decodes = MIXED_EXT.index(max(MIXED_EXT))
    assert mixed_meta_kind(case, **options) == ((MixedMeta, decodes) if split == "always" else (ExtendMeta, 0))
    case.check(replace(SMALL, decode_splits=3), **options)


def test_mixed_batch_without_leading_decodes_or_without_chunks():
    """D = 0 (the batch opens with a chunk: a one-token row after it stays in the extend kernel) and D = every
    row (a plain decode batch) give the torch reference, whatever the threshold."""
    chunk_first = Case([0, 12, 5, 40], [9, 1, 6, 1], 6, 2, HEAD_DIMS[0], 4, seed=21)
    assert mixed_meta_kind(chunk_first, **SPLIT_ALWAYS) == (ExtendMeta, 0)
    chunk_first.check(SMALL, **SPLIT_ALWAYS)
    all_decodes = Case([3, 40, 17], [1, 1, 1], 6, 2, HEAD_DIMS[0], 4, seed=22)
    assert mixed_meta_kind(all_decodes, **SPLIT_ALWAYS) == (DecodeMeta, 0)
    all_decodes.check(replace(SMALL, decode_splits=3), **SPLIT_ALWAYS)


def test_mixed_split_threshold_counts_the_decode_rows_kv_bytes():
    """The default threshold: below MIXED_SPLIT_KV_BYTES of the decode rows' K/V in one layer (cached tokens and
    their new one) the batch stays one extend launch; at it, the decode rows split off."""
    case = Case(MIXED_KV, MIXED_EXT, 4, 2, 16, 4, seed=23)
    decodes = case.batch.decode_rows
    token_bytes = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, fp32
    kv_bytes = (case.batch.decode_kv_tokens + decodes) * token_bytes
    assert mixed_meta_kind(case, mixed_split_kv_bytes=kv_bytes) == (MixedMeta, decodes)
    assert mixed_meta_kind(case, mixed_split_kv_bytes=kv_bytes + 1) == (ExtendMeta, 0)
    assert mixed_meta_kind(case) == (ExtendMeta, 0)  # ~27 KB here: far below the default


SENTINEL = 7.0  # what `out` holds before a padded step: rows nobody owns must keep it


def run_static_step(case: Case, heads: int, decodes: int, decode_cap: int, chunk_cap: int, extra_tokens: int,
                    config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's step as a whole-step CUDA graph runs it (StaticStepMeta: caps above the step's counts, padding
    entries, a grid for `extra_tokens` more tokens than it has), and the torch reference. The q rows past the
    real tokens are random (a graph's padding rows hold stale activations); `out` starts as SENTINEL."""
    expected, ref_pool = case.run(TorchBackend)
    pool = copy.copy(case.pool)
    pool.k, pool.v = ref_pool.k.clone(), ref_pool.v.clone()  # the new K/V stored, as the model's rope does
    backend = TritonBackend(pool, case.page_table, config)
    pad_row = case.page_table.shape[0] - 1
    static = StaticStepMeta(backend, heads, max(decode_cap, 3), max(chunk_cap, 5), pad_row)
    tokens = case.num_real + extra_tokens
    meta = static.meta(tokens, decode_cap, chunk_cap)
    b = case.batch
    static.write(b.rows.tolist(), b.kv_lens.tolist(), b.extend_lens.tolist(), decodes)
    gen = torch.Generator().manual_seed(99)
    q = torch.cat([case.q, torch.randn((extra_tokens, *case.q.shape[1:]), generator=gen).to(case.q)])
    out = torch.full((tokens, q.shape[1] * q.shape[2]), SENTINEL, dtype=q.dtype, device=q.device)
    got = backend.attend(LAYER, q, meta, out)
    assert got.data_ptr() == out.data_ptr()
    return got, expected


def assert_static_step(case: Case, heads: int, decodes: int, decode_cap: int, chunk_cap: int, extra_tokens: int,
                       config: KernelConfig) -> None:
    got, expected = run_static_step(case, heads, decodes, decode_cap, chunk_cap, extra_tokens, config)
    tol = TOLERANCE[case.q.dtype]
    real = case.num_real
    torch.testing.assert_close(got[:real].float(), expected[:real].float(), atol=tol, rtol=tol)
    assert (got[real:] == SENTINEL).all()  # padding rows: no program wrote them


@pytest.mark.parametrize("block_r", [4, 64])  # 4: the extend programs find their request over several loads
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_static_step_meta_with_padding_matches_torch(heads, kv_heads, page_size, block_r, monkeypatch):
    """A mixed step (decodes of various contexts, then ragged chunks, some after a cached prefix) through padded
    static metadata: more decode rows and chunk entries than the step has, a tile grid sized for a bucket of
    more tokens. The real rows give the reference; the padding rows of `out` stay as they were."""
    monkeypatch.setattr(kernels, "EXTEND_BLOCK_R", block_r)
    kv = [30, 7, 64, 0, 0, 21, 0, 40, 3]
    ext = [1, 1, 1, 1, 25, 14, 3, 9, 33]
    case = Case(kv, ext, heads, kv_heads, HEAD_DIMS[0], page_size, seed=30)
    assert_static_step(case, heads, 4, decode_cap=7, chunk_cap=11, extra_tokens=37,
                       config=replace(SMALL, decode_splits=3))


@pytest.mark.parametrize("splits", [1, 3])
def test_static_step_meta_prefill_only_and_decode_only(splits):
    """No decode rows (every decode entry padding) and no chunks (every chunk entry padding, an empty tile list)."""
    config = replace(SMALL, decode_splits=splits)
    prefill = Case([0, 12, 5, 40], [9, 1, 6, 17], 6, 2, HEAD_DIMS[0], 4, seed=31)
    assert_static_step(prefill, 6, 0, decode_cap=4, chunk_cap=6, extra_tokens=20, config=config)
    decode = Case([3, 40, 17, 0], [1, 1, 1, 1], 6, 2, HEAD_DIMS[0], 4, seed=32)
    assert_static_step(decode, 6, 4, decode_cap=9, chunk_cap=2, extra_tokens=5, config=config)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_leaves_padded_rows_alone(splits):
    """Decode rows of seq_len 0 (a graph's padding) exit at once: their rows of `out` keep what they held, and the
    split counters stay zeros."""
    case = Case([3, 40, 17], [1, 1, 1], 6, 2, HEAD_DIMS[0], 4, seed=33)
    expected, pool = case.run(TorchBackend)
    backend = TritonBackend(pool, case.page_table, replace(SMALL, decode_splits=splits))
    pad_row = case.page_table.shape[0] - 1
    rows = torch.cat([case.batch.rows, torch.full((5,), pad_row, device=DEVICE)])
    seq_lens = torch.cat([case.batch.seq_lens, torch.zeros(5, dtype=torch.int64, device=DEVICE)])
    meta = DecodeMeta(rows, seq_lens, splits)
    q = torch.cat([case.q, torch.randn((5, *case.q.shape[1:])).to(case.q)])
    out = torch.full((8, q.shape[1] * q.shape[2]), SENTINEL, dtype=q.dtype, device=DEVICE)
    backend.attend(LAYER, q, meta, out)
    torch.testing.assert_close(out[:3], expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    assert (out[3:] == SENTINEL).all()
    assert meta.scratch is None or not meta.scratch[2].any()


def test_eager_extend_over_many_requests_finds_each_tile(monkeypatch):
    """An eager step's tile list over more requests than one load of tile_ends covers (EXTEND_BLOCK_R 4 here),
    with requests of zero tiles nowhere (every request owns at least one token) and a grid above the real tiles."""
    monkeypatch.setattr(kernels, "EXTEND_BLOCK_R", 4)
    kv = [0, 9, 2, 0, 17, 5, 0, 33, 1, 0, 4]
    ext = [5, 2, 19, 1, 7, 40, 3, 2, 11, 6, 1]
    Case(kv, ext, 4, 2, HEAD_DIMS[0], 4, seed=34).check(SMALL)


def test_decode_split_choice_fills_the_gpu():
    """Splits come from batch size and SM count only (a captured graph replays for any lengths): small
    batches get enough programs for every SM, large ones need no split."""
    config = KernelConfig()
    for batch in (1, 2, 8, 32, 128, 256):
        splits = num_decode_splits(batch, kv_heads=8, num_sms=132, config=config)
        assert 1 <= splits <= config.max_splits
        assert batch * 8 * splits >= 132 or splits == config.max_splits
        assert splits == 1 or batch * 8 * (splits - 1) < config.programs_per_sm * 132
    assert num_decode_splits(256, 8, 132, config) == 1
    assert num_decode_splits(1, 8, 132, KernelConfig(decode_splits=5)) == 5


def test_default_config():
    """The backend's own choices (tile sizes for the dtype, automatic splits) on a decode and a ragged batch."""
    Case(DECODE_KV, [1] * len(DECODE_KV), 4, 2, 16, 16, seed=4).check()
    Case(RAGGED_KV, RAGGED_EXT, 4, 2, 16, 16, seed=4).check()


def test_rejects_unsupported_kv_dtype():
    pool = KVPool(1, 4, 16, 2, 16, torch.int8, torch.device("cpu"))
    with pytest.raises(ValueError, match="KV dtypes"):
        make_backend("triton", pool, torch.zeros(2, 2, dtype=torch.int32))


def test_llm_greedy_equals_transformers(tiny_models):
    """End to end on the tiny qwen3 (GQA 2, head_dim 16): chunked prefill over pages of 16, then decode."""
    path = tiny_models["qwen3"]
    prompts = random_prompts([1, 7, 19, 40], vocab=400, seed=9)
    with make_llm(path, attention_backend="triton", page_size=16, max_prefill_tokens=24) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 6)
