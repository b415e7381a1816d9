"""Packed SFT: response-only loss, attention confined to each sample, FLOPs per sample."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lpbench.data.sft import (
    IGNORE_INDEX,
    MockSFTDataset,
    build_sequence,
    build_sft_dataset,
    pack_best_fit,
    sample_tokens,
)
from lpbench.data.tokenizer import ByteTokenizer
from lpbench.errors import UsageError
from lpbench.metrics.flops import (
    attention_flops_per_token,
    flops_per_token,
    packed_attention_len,
    packed_flops_per_token,
    tflops_per_gpu,
)
from lpbench.models import MODELS, build_model
from lpbench.models import decoder as decoder_mod

TINY = dataclasses.replace(MODELS["tiny"], n_layers=2, vocab_size=300)
EOS = 299


def make_samples(lengths, seed=0):
    """(tokens, n_prompt) samples with prompt/response lengths ``lengths``."""
    rng = np.random.default_rng(seed)
    out = []
    for lp, lr in lengths:
        tokens, n_prompt, _ = sample_tokens(rng.integers(0, EOS, lp), rng.integers(0, EOS, lr), EOS, 1000)
        out.append((tokens, n_prompt))
    return out


def batch_of(samples, seq_len):
    seq = build_sequence(samples, seq_len, EOS)
    return {k: torch.from_numpy(v)[None] for k, v in seq.items() if k != "sample_lengths"}, seq["sample_lengths"]


# --------------------------------------------------------------------------- labels and loss


def test_labels_cover_response_and_eos_only():
    samples = make_samples([(5, 3), (1, 4), (7, 2)])
    b, lengths = batch_of(samples, 40)
    assert lengths == [8, 5, 9]
    labels, inputs, docs = b["labels"][0], b["input_ids"][0], b["doc_ids"][0]
    expected_targets = []
    for tokens, n_prompt in samples:
        expected_targets += list(tokens[n_prompt:])  # response tokens and EOS
    assert labels[labels != IGNORE_INDEX].tolist() == [int(t) for t in expected_targets]
    # sample 0: positions 0..7 hold tokens[:-1]; labels are -100 while the next token is a prompt token
    assert labels[:4].eq(IGNORE_INDEX).all() and labels[4:8].ne(IGNORE_INDEX).all()
    assert labels[7] == EOS  # the last position of a sample predicts its EOS, never the next sample
    assert docs.tolist() == [0] * 8 + [1] * 5 + [2] * 9 + [-1] * 18
    assert b["position_ids"][0, :13].tolist() == list(range(8)) + list(range(5))
    assert labels[22:].eq(IGNORE_INDEX).all() and inputs[22:].eq(EOS).all()  # padding


def test_loss_ignores_prompt_tokens():
    samples = make_samples([(6, 3), (9, 4), (4, 5)])
    b, _ = batch_of(samples, 32)
    model = build_model(TINY, device="cpu", seed=0)
    with torch.no_grad():
        loss = model(b["input_ids"], b["labels"], doc_ids=b["doc_ids"])
        logits = model(b["input_ids"], doc_ids=b["doc_ids"])[0]
    resp = b["labels"][0] != IGNORE_INDEX
    assert resp.sum() == sum(len(t) - p for t, p in samples)
    manual = F.cross_entropy(logits[resp].float(), b["labels"][0][resp])
    torch.testing.assert_close(loss, manual)
    # the loss is blind to what the prompt positions would have to predict
    everything = b["input_ids"][0].roll(-1).clone()
    everything[resp] = b["labels"][0][resp]
    all_loss = F.cross_entropy(logits.float(), everything)
    assert not torch.allclose(all_loss, loss)


# --------------------------------------------------------------------------- document masking


@pytest.fixture(params=["sdpa", "flex"])
def backend(request, monkeypatch):
    monkeypatch.setattr(decoder_mod, "DOC_MASK_BACKEND", request.param)
    return request.param


VARIANTS = {
    "llama": TINY,
    "qwen3": dataclasses.replace(TINY, head_dim=48, qk_norm=True),
    "gpt3": dataclasses.replace(TINY, norm="layer", activation="gelu", positions="learned", bias=True),
}


@pytest.mark.parametrize("family", VARIANTS)
def test_no_attention_crosses_a_sample_boundary(family, backend):
    cfg = VARIANTS[family]
    model = build_model(cfg, device="cpu", seed=0)
    samples = make_samples([(7, 4), (10, 6), (5, 3)], seed=1)
    b, lengths = batch_of(samples, 48)
    a_end, b_end = lengths[0], lengths[0] + lengths[1]
    perturbed = b["input_ids"].clone()
    perturbed[0, a_end:b_end] = (perturbed[0, a_end:b_end] + 17) % EOS  # the middle sample's tokens
    with torch.no_grad():
        ref = model(b["input_ids"], doc_ids=b["doc_ids"])
        out = model(perturbed, doc_ids=b["doc_ids"])
        alone = model(b["input_ids"][:, b_end : b_end + lengths[2]])
    torch.testing.assert_close(out[:, :a_end], ref[:, :a_end], rtol=0, atol=0)  # before: causal anyway
    torch.testing.assert_close(out[:, b_end:], ref[:, b_end:], rtol=0, atol=1e-6)  # after: confined
    assert not torch.allclose(out[:, a_end:b_end], ref[:, a_end:b_end])
    # the last sample sees what it would see alone (positions restart at 0)
    torch.testing.assert_close(ref[:, b_end : b_end + lengths[2]], alone, rtol=1e-5, atol=1e-5)
    # and without doc_ids it would have seen its neighbours
    with torch.no_grad():
        plain = model(b["input_ids"])
    assert not torch.allclose(plain[:, b_end : b_end + lengths[2]], alone, atol=1e-3)


def test_one_document_equals_plain_causal_and_backends_agree(monkeypatch):
    model = build_model(TINY, device="cpu", seed=0)
    x = torch.randint(0, EOS, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(x)
        one_doc = model(x, doc_ids=torch.zeros_like(x))
        docs = torch.tensor([[0] * 10 + [1] * 30, [5] * 25 + [-1] * 15])
        monkeypatch.setattr(decoder_mod, "DOC_MASK_BACKEND", "sdpa")
        sdpa = model(x, doc_ids=docs)
        monkeypatch.setattr(decoder_mod, "DOC_MASK_BACKEND", "flex")
        flex = model(x, doc_ids=docs)
    torch.testing.assert_close(one_doc, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_a_compiled_block_traces_flex_attention_into_its_one_graph():
    """A block compiled as ``train`` compiles it, fed a flex document mask, is one graph: flex attention is traced
    in it, not called through a warnings filter Dynamo cannot trace (which broke SFT and LoRA blocks into seven)."""
    import torch._dynamo

    model = build_model(TINY, device="cpu", seed=0)
    runs, _ = decoder_mod.document_runs(torch.tensor([[0] * 24 + [1] * 40]))
    mask = decoder_mod.document_mask(runs, backend="flex")
    rope = decoder_mod.rope_tables(TINY, 64, torch.device("cpu"))
    x = torch.randn(1, 64, TINY.dim)

    def block(x):
        with torch.no_grad():  # flex attention has no CPU backward
            return model.layers[0](x, rope, mask)

    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize(
    "seq,batch,cp",
    [(64, 1, False), (300, 2, False), (1000, 1, False), (1024, 3, True)],
    ids=["one-block", "ragged", "ragged-long", "cp-places"],
)
def test_the_document_block_mask_is_create_block_masks(seq, batch, cp):
    """The block mask built a few block rows at a time has torch's blocks, full and partial, for both passes,
    in torch's order: the whole sequence's queries and a CP rank's two chunks (rank 0 of 2), lengths that are
    and are not whole blocks, chunks of one block row."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(seq)
    starts = seq // 2 + torch.randint(-seq // 4, seq // 2, (batch, 3), generator=g)  # a long first run, then any
    ids = (torch.arange(seq) >= starts[..., None]).sum(1)
    runs, _ = decoder_mod.document_runs(ids)
    keys = torch.arange(seq)
    quarter = seq // 4
    query = torch.cat([keys[:quarter], keys[3 * quarter :]]) if cp else keys

    def visible(b, h, q_idx, kv_idx):
        return (runs[b, query[q_idx]] == runs[b, kv_idx]) & (query[q_idx] >= kv_idx)

    ref = create_block_mask(visible, batch, None, len(query), seq, device="cpu")
    ours = decoder_mod._block_mask(runs, query, keys, visible, chunk_elements=1)
    assert (ours.seq_lengths, ours.BLOCK_SIZE) == (ref.seq_lengths, ref.BLOCK_SIZE)
    for part in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        for side in (part, part.replace("kv", "q")):
            assert torch.equal(getattr(ours, side), getattr(ref, side)), side
    assert ref.full_kv_num_blocks.sum() > 0 or seq < 1000  # full blocks where the first run spans several
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_document_runs_and_gradients_stay_inside_samples():
    runs, pos = decoder_mod.document_runs(torch.tensor([[3, 3, 3, 1, 1, 3, -1, -1]]))
    assert runs.tolist() == [[1, 1, 1, 2, 2, 3, 4, 4]]  # a repeated id later is a new document
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    model = build_model(TINY, device="cpu", seed=0)
    samples = make_samples([(6, 4), (6, 4)], seed=2)
    b, lengths = batch_of(samples, 20)
    emb = model.tok_embeddings(b["input_ids"]).detach().requires_grad_(True)
    model.tok_embeddings.forward = lambda ids: emb  # differentiate w.r.t. the embeddings
    labels = b["labels"].clone()
    labels[:, : lengths[0]] = IGNORE_INDEX  # loss on the second sample only
    model(b["input_ids"], labels, doc_ids=b["doc_ids"]).backward()
    assert emb.grad[0, : lengths[0]].abs().max() == 0
    assert emb.grad[0, lengths[0] : sum(lengths)].abs().max() > 0


# --------------------------------------------------------------------------- packing and data sources


def test_best_fit_packs_every_sample_once_within_seq_len():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 500).tolist()
    bins = pack_best_fit(lengths, 128, seed=1)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= 1.1 * sum(lengths) / 128 + 1  # near-full sequences
    assert bins == pack_best_fit(lengths, 128, seed=1) and bins != pack_best_fit(lengths, 128, seed=2)


def test_truncation_keeps_the_response():
    tokens, n_prompt, cut = sample_tokens(list(range(50)), [100, 101, 102], EOS, seq_len=20)
    assert cut and len(tokens) == 21 and n_prompt == 17
    assert tokens[:17].tolist() == list(range(33, 50)) and tokens[17:].tolist() == [100, 101, 102, EOS]
    tokens, n_prompt, cut = sample_tokens([1, 2], list(range(100, 130)), EOS, seq_len=20)
    assert cut and len(tokens) == 21 and n_prompt == 1 and tokens[-1] == 119  # response cut, no EOS
    tokens, n_prompt, _ = sample_tokens([], [5], EOS, seq_len=20)
    assert tokens.tolist() == [EOS, 5, EOS] and n_prompt == 1  # an empty prompt starts with EOS


def test_jsonl_prompt_response_and_squad(tmp_path):
    (tmp_path / "pr.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "Q: 2+2?", "response": " 4"},
                {"prompt": "Hi", "response": ""},
                {"prompt": "Say yes", "response": " yes"},
            ]
        )
        + "\n"
    )
    data = build_sft_dataset(str(tmp_path / "pr.jsonl"), seq_len=64, val_samples=0)
    tok = ByteTokenizer()
    texts = sorted(tok.decode(t[:p]) + "|" + tok.decode(t[p:]) for t, p in data.train.samples)
    assert texts == ["Q: 2+2?| 4", "Say yes| yes"]  # EOS (256) is dropped by decode; the empty one skipped
    assert all(t[-1] == tok.eos_id for t, _ in data.train.samples)
    assert "1 skipped" in data.describe()

    squad = [
        {
            "context": "Paris is in France.",
            "question": "Where is Paris?",
            "answers": {"text": ["France", "in France"], "answer_start": [12, 9]},
        },
        {"context": "x", "question": "unanswerable?", "answers": {"text": [], "answer_start": []}},
        {"context": "Sky.", "question": "Colour?", "answer": "blue"},
    ]
    (tmp_path / "squad.jsonl").write_text("\n".join(json.dumps(r) for r in squad))
    data = build_sft_dataset(str(tmp_path / "squad.jsonl"), seq_len=128, val_samples=0)
    texts = sorted(tok.decode(t[:p]) + "|" + tok.decode(t[p:]) for t, p in data.train.samples)
    assert texts == [
        "Context: Paris is in France. Question: Where is Paris? Answer:| France",
        "Context: Sky. Question: Colour? Answer:| blue",
    ]

    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no pair"}) + "\n")
    with pytest.raises(UsageError, match="cannot tell prompt from response"):
        build_sft_dataset(str(tmp_path / "bad.jsonl"), seq_len=64)
    data = build_sft_dataset(
        str(tmp_path / "bad.jsonl"), seq_len=64, prompt_key="text", response_key="text", val_samples=0
    )
    assert len(data.train) == 1


def test_real_data_splits_and_loader(tmp_path):
    rows = [{"input": f"question {i} " * (i % 5 + 1), "output": f" answer {i}"} for i in range(60)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = build_sft_dataset(str(tmp_path / "d.jsonl"), seq_len=128, val_fraction=0.1, seed=3)
    assert len(data.train.samples) == 54 and len(data.valid.samples) == 6
    train_set = {tuple(t) for t, _ in data.train.samples}
    assert not train_set & {tuple(t) for t, _ in data.valid.samples}
    batch = next(data.train_loader(2))
    assert {k: tuple(v.shape) for k, v in batch.items() if k != "sample_lengths"} == {
        "input_ids": (2, 128),
        "labels": (2, 128),
        "doc_ids": (2, 128),
        "position_ids": (2, 128),
    }
    assert len(batch["sample_lengths"]) == 2
    for row, lens in zip(batch["doc_ids"], batch["sample_lengths"]):
        assert [int((row == k).sum()) for k in range(len(lens))] == lens
    assert sorted(n for seq in data.flops_sample_lengths() for n in seq) == sorted(
        len(t) - 1 for t, _ in data.train.samples
    )
    n_valid = sum(b["input_ids"].shape[0] for b in data.valid_batches(2))
    assert n_valid == len(data.valid) >= 1


def test_mock_sft_is_seeded_packed_and_learnable():
    ds = MockSFTDataset(vocab_size=300, seq_len=256, seed=4, prompt_len=(10, 40), response_len=(3, 12))
    a, b = ds[7], ds[7]
    assert all(np.array_equal(a[k], b[k]) for k in ("input_ids", "labels", "doc_ids"))
    assert not np.array_equal(ds[8]["input_ids"], a["input_ids"])
    assert 256 - sum(a["sample_lengths"]) <= 1 and len(a["sample_lengths"]) > 3
    resp = a["labels"] != IGNORE_INDEX
    # every response target continues the walk (previous token + one of the fixed offsets) or is EOS
    steps = (a["labels"][resp] - a["input_ids"][resp]) % (ds.vocab_size - 1)
    is_eos = a["labels"][resp] == ds.eos_id
    assert set(steps[~is_eos].tolist()) <= set(ds.offsets.tolist())
    assert is_eos.sum() == len(a["sample_lengths"]) and (a["labels"][resp] < ds.vocab_size).all()
    # a tiny model learns the responses: well below the uniform loss within 40 steps
    vocab = 32
    data = build_sft_dataset("mock", seq_len=64, vocab_size=vocab, seed=0, prompt_len=(4, 12), response_len=(8, 16))
    model = build_model(dataclasses.replace(TINY, n_layers=1, vocab_size=vocab), device="cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader, losses = data.train_loader(4), []
    for _ in range(40):
        bt = next(loader)
        loss = model(bt["input_ids"], bt["labels"], doc_ids=bt["doc_ids"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < np.log(vocab - 1) - 0.5


# --------------------------------------------------------------------------- FLOPs


def test_sft_flops_count_attention_per_sample():
    cfg = MODELS["llama3-8b"]
    h, L, V, ffn, q, kv = 4096, 32, 128256, 14336, 4096, 1024
    dense = 18 * h * ffn * L + 6 * (h * (q + 2 * kv) + q * h) * L + 6 * h * V
    # megatron: 6·q·s·L per token becomes 6·q·L·Σl² per sequence
    lengths = [[3000, 1000, 96], [4096]]
    expected = dense + 6 * q * L * (3000**2 + 1000**2 + 96**2 + 4096**2) / (2 * 4096)
    assert packed_flops_per_token(cfg, 4096, lengths) == pytest.approx(expected, rel=1e-12)
    assert packed_attention_len([[4096]], 4096) == 4096  # one full sample = dense pretraining
    assert packed_flops_per_token(cfg, 4096, [[4096]], "nemo-legacy") == flops_per_token(cfg, 4096, "nemo-legacy")
    assert attention_flops_per_token(cfg, 8192, "mha") == pytest.approx(12 * L * h * 8192)
    with pytest.raises(UsageError):
        packed_attention_len([[3000, 2000]], 4096)


def test_sft_flops_reproduce_nemo_llama3_8b_table():
    # NeMo 25.04 fine-tuning table, GB200: Llama3-8B SFT, SQuAD packed to 16384, 33,437 tok/s <-> 1,515 TFLOP/s.
    cfg = MODELS["llama3-8b"]
    squad_like = [[180] * 91]  # Σl²/16384 ≈ 180: SQuAD samples are ~180 tokens
    fpt = packed_flops_per_token(cfg, 16384, squad_like, "nemo-legacy")
    assert tflops_per_gpu(fpt, 33437) == pytest.approx(1515, rel=0.002)
    # counting attention over the whole packed sequence (seq_len²) would overstate it by half
    assert tflops_per_gpu(flops_per_token(cfg, 16384, "nemo-legacy"), 33437) > 1.5 * 1515


@pytest.mark.gpu
def test_flex_on_cuda_matches_sdpa_forward_and_backward(monkeypatch):
    model = build_model(TINY, device="cuda", seed=0)
    samples = make_samples([(30, 10), (50, 20), (20, 5)], seed=3)
    b, _ = batch_of(samples, 160)
    b = {k: v.cuda() for k, v in b.items()}
    results = {}
    for backend in ("flex", "sdpa"):
        monkeypatch.setattr(decoder_mod, "DOC_MASK_BACKEND", backend)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(b["input_ids"], b["labels"], doc_ids=b["doc_ids"])
        loss.backward()
        results[backend] = (loss.detach(), model.layers[0].attn.qkv.weight.grad.clone())
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results["flex"][1], results["sdpa"][1], rtol=5e-2, atol=5e-3)


@pytest.mark.gpu
def test_flex_document_mask_memory_is_linear_in_seq(monkeypatch):
    """Packed SFT at seq 16,384 on CUDA: flex attention's block mask skips masked blocks and makes no [S, S]
    mask, so doubling the sequence doubles the peak (an SDPA bool mask alone would quadruple, 256 MiB at 16K)."""
    monkeypatch.setattr(decoder_mod, "DOC_MASK_BACKEND", "flex")
    peaks = {}
    for seq in (8192, 16384):
        model = build_model(dataclasses.replace(TINY, max_seq_len=seq), device="cuda", seed=0)
        ids = torch.randint(0, EOS, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        docs = (torch.arange(seq, device="cuda") // 1000)[None]  # samples of 1,000 tokens
        model(ids, ids.roll(-1, 1), doc_ids=docs).backward()  # compile flex and its block mask first
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, ids.roll(-1, 1), doc_ids=docs)
        loss.backward()
        peaks[seq] = torch.cuda.max_memory_allocated() - base
    assert peaks[16384] < 2.5 * peaks[8192], peaks  # S²: 4x
    assert peaks[16384] < 16384 * 16384, peaks  # less than one [S, S] bool mask
