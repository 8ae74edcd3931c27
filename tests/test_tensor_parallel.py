"""Tensor parallelism (ADR 0007) on CPU over gloo: the plan, the sharded layers (dense and packed),
every family's sharded forward against the unsharded one, the bundled model at TP=2 against TP=1
(greedy and seeded; bitwise under --deterministic), a dead rank, and bad sizes.

The family checks run both ranks in threads of this process, each with its own gloo group (real
collectives, no spawn); the engine checks spawn rank 1 as the engine does, one engine per mode for
the whole module.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from monobatch.batch import StepBatch
from monobatch.distributed.comm import TpGroup, free_port
from monobatch.distributed.plan import TensorParallelPlan, check_devices, split_points
from monobatch.distributed.runtime import TensorParallelError
from monobatch.distributed.sharding import attach, packed_cols_ok, shard_model, take_cols, take_rows
from monobatch.engine.params import SamplingParams
from monobatch.errors import InvalidRequestError
from monobatch.kv.dense import DenseKv
from monobatch.models.args import ModelArgs
from monobatch.quant.packed import PackedWeight

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, seed=7, top_k=40, repeat_penalty=1.1, ignore_eos=True)


# -- the plan ---------------------------------------------------------------------------------------

def test_plan_splits_whole_gqa_groups(loaded):
    args = loaded.model.args  # 9 query heads, 3 KV heads, FFN 1536, vocab 49152
    plan = TensorParallelPlan.build(args, 2)
    assert plan.owner == (0, 2, 3) and [plan.kv_heads(r) for r in range(2)] == [2, 1]
    assert plan.heads_per_piece == 3 and plan.ffn == (0, 512, 1024, 1536)
    assert plan.vocab_range(0) == (0, 32768) and plan.vocab_range(1) == (32768, 49152)
    assert all(b % 32 == 0 for b in split_points(14336, 8, 32))


@pytest.mark.parametrize("world, words", [(4, "3 KV heads"), (0, ">= 1")])
def test_plan_refuses_bad_sizes(loaded, world, words):
    with pytest.raises(InvalidRequestError, match=words):
        TensorParallelPlan.build(loaded.model.args, world)


# -- sharded weights --------------------------------------------------------------------------------

def test_too_few_cuda_devices_are_refused_before_spawning():
    """Rank r runs on cuda:(first + r): TP=2 from cuda:0 needs 2 visible devices, from cuda:1 three."""
    check_devices("cuda", 0, 2, 2)
    check_devices("cpu", 0, 4, 0)  # CPU ranks share the CPU
    for first, visible in ((0, 1), (1, 2), (0, 0)):
        with pytest.raises(InvalidRequestError, match=f"needs CUDA devices {first}..{first + 1}, but {visible}"):
            check_devices("cuda", first, 2, visible)


def test_packed_rows_and_columns_are_the_dequantized_slices(loaded):
    qkv = loaded.model.layers[0].self_attn.qkv_proj.weight  # packed Q4_1 [960, 576]
    down = loaded.model.layers[0].mlp.down_proj.weight  # packed [576, 1536]
    assert isinstance(qkv, PackedWeight) and isinstance(down, PackedWeight)
    full = qkv.dequantize()
    rows = take_rows(qkv, [(0, 192), (576, 640), (768, 832)], copy_=True)
    assert torch.equal(rows.dequantize(), torch.cat([full[0:192], full[576:640], full[768:832]]))
    assert torch.equal(take_cols(down, 512, 1024).dequantize(), down.dequantize()[:, 512:1024])
    assert packed_cols_ok(down, 512, 1024) and not packed_cols_ok(down, 16, 1024)


def test_a_cut_off_the_quant_groups_dequantizes_that_weight(loaded, caplog):
    from monobatch.distributed.sharding import _dense_if_uncut

    down = loaded.model.layers[0].mlp.down_proj.weight
    with caplog.at_level(logging.WARNING, logger="monobatch.distributed.sharding"):
        dense = _dense_if_uncut(down, [0, 16, 1536], "layers.0.mlp.down_proj")
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, down.dequantize())
    assert "misses its quantization groups" in caplog.text
    assert _dense_if_uncut(down, [0, 512, 1536], "x") is down


def _random_model(model_type: str, **extra):
    """A tiny random model of a family (2 layers, 4 query / 2 KV heads)."""
    from monobatch.loader.weights import new_model

    args = ModelArgs.from_dict({"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 128,
                                "tie_word_embeddings": model_type != "qwen2", **extra})
    model = new_model(args, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                     else 0.05 * torch.randn(p.shape, generator=gen))
    return model


def _forward(model, kv_heads: int, tokens: list[int], row_tile: int) -> torch.Tensor:
    """One prompt through ``model`` on a fresh dense store: ``[T, V]`` logits of every position."""
    args = model.args
    model.build_rope_tables(64, model.dtype)
    kv = DenseKv(args.num_hidden_layers, kv_heads, args.head_dim, 64, model.dtype, model.device,
                 windows=args.layer_windows())
    batch = StepBatch.build([(0, tokens, 0, True, True)], "cpu", row_tile)
    kv.prepare(batch)
    with torch.inference_mode():
        return model(batch, kv)


def _run_ranks(model, world: int, tokens: list[int], pieces: bool) -> torch.Tensor:
    """Every rank's shard of ``model`` in its own thread with its own gloo group: the driver's logits."""
    plan = TensorParallelPlan.build(model.args, world)
    port, out, errors = free_port(), [None] * world, []
    shards = [shard_model(model, plan, r, pieces, copy_=True) for r in range(world)]

    def rank(r: int) -> None:
        try:
            attach(shards[r], TpGroup(r, world, port, timeout_s=60))
            out[r] = _forward(shards[r], plan.kv_heads(r), tokens, 8 if pieces else 0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out[0]


FAMILIES = [("llama", {}), ("mistral", {}), ("qwen2", {"attention_bias": True}), ("qwen3", {}),
            ("gemma3_text", {"sliding_window": 4, "query_pre_attn_scalar": 16})]


@pytest.mark.parametrize("family, extra", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_every_family_shards_the_same_way(family, extra):
    """Fast mode: TP=2's logits equal the unsharded model's to float rounding; deterministic mode:
    TP=2's are TP=1's bits (the same pieces, summed in the same order)."""
    model = _random_model(family, **extra)
    tokens = [5, 17, 301, 42, 7, 99, 3, 250, 11]
    full = _forward(model, model.args.num_key_value_heads, tokens, 0)
    fast = _run_ranks(model, 2, tokens, pieces=False)
    torch.testing.assert_close(fast, full, rtol=1e-4, atol=1e-4)
    one = shard_model(model, TensorParallelPlan.build(model.args, 1), 0, pieces=True, copy_=False)
    det1 = _forward(one, model.args.num_key_value_heads, tokens, 8)
    assert torch.equal(_run_ranks(model, 2, tokens, pieces=True), det1)
    torch.testing.assert_close(det1, full, rtol=1e-4, atol=1e-4)


# -- the engine at TP=2 on the bundled model --------------------------------------------------------

def _generate(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS * 2, [GREEDY, GREEDY, SEEDED, SEEDED])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def deterministic_pair(loaded):
    """(TP=1, TP=2) under --deterministic, sharing the loaded weights."""
    from monobatch.llm import LLM

    tp1 = LLM(loaded=loaded, deterministic=True)
    tp2 = LLM(loaded=loaded, deterministic=True, tensor_parallel_size=2)
    yield tp1, tp2
    tp2.close()


def test_deterministic_tp2_tokens_and_logits_are_tp1s(deterministic_pair, loaded):
    tp1, tp2 = deterministic_pair
    assert "tensor parallel 2 ranks (KV heads 2+1 of 3)" in tp2.scheduler.engine.describe()
    assert _generate(tp2) == _generate(tp1)
    ids = loaded.tokenizer.encode(PROMPTS[1])
    assert torch.equal(tp2.scheduler.engine.prompt_logits(ids, all_positions=True),
                       tp1.scheduler.engine.prompt_logits(ids, all_positions=True))


def test_prefix_hit_on_every_rank(deterministic_pair):
    """The same prompt again adopts cached blocks on every rank (the workers replay the driver's
    adopt_prefix and compare its result and the block tables each step) and gives the same tokens."""
    _, tp2 = deterministic_pair
    prompt = "A long shared system prompt that fills more than one block of sixteen tokens, " * 2
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = tp2.generate([prompt], params)[0]
    again = tp2.generate([prompt], params)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_fast_mode_tp2_diverges_at_most_at_a_near_tie(dequantized):
    """Fast mode, TP=2 against TP=1: a different float sum (the all-reduce), not a different
    function. On ``--weights dequant`` (the sharding is under test; the packed shards are held to
    TP=1's bits in deterministic mode above): on packed weights the two sums flip some of the
    int16-activation GEMV's roundings (7.8e-3 apart; ADR 0006, "int16 activations")."""
    from monobatch.llm import LLM
    from monobatch.parity.report import compare

    tp1 = LLM(loaded=dequantized)
    with LLM(loaded=dequantized, tensor_parallel_size=2) as tp2:  # LLM.close() stops the ranks on leaving
        ref, got = _generate(tp1), _generate(tp2)
        ids = dequantized.tokenizer.encode(PROMPTS[0])
        diff = (tp2.scheduler.engine.prompt_logits(ids) - tp1.scheduler.engine.prompt_logits(ids)).abs().max()
    assert not any(p.is_alive() for p in tp2.scheduler.engine.tp.procs)
    with pytest.raises(RuntimeError, match="closed"):
        tp2.generate([PROMPTS[0]], GREEDY)
    tp2.close()  # idempotent
    assert 0 < diff < 1e-3  # a different float sum (the all-reduce), not a different function
    for prompt, a, b in zip(PROMPTS * 2, ref, got):
        div = compare(dequantized.tokenizer.encode(prompt), a, b, tp1.scheduler.engine.top2_margin)
        assert div is None or div.margin < 0.05, div


def test_a_dead_rank_ends_the_engine_with_a_clear_error():
    from monobatch.llm import LLM
    from monobatch.loader.dummy import dummy_model

    llm = LLM(loaded=dummy_model("tiny", "cpu"), tensor_parallel_size=2)
    engine = llm.scheduler.engine
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)[0].outputs[0].token_ids) == 8
    worker = engine.tp.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 exited \(exit code -9\)"):
        llm.generate([{"prompt_token_ids": [4, 5, 6]}], GREEDY)
    assert time.monotonic() - start < 30  # not a hang: an error within seconds, not the 300 s timeout
    with pytest.raises(TensorParallelError, match="cannot continue"):
        llm.generate([{"prompt_token_ids": [7]}], GREEDY)


@pytest.mark.parametrize("size, words", [("3", "2 KV heads"), ("0", ">= 1")])
def test_cli_bad_size_is_one_line_and_exit_1(size, words):
    proc = subprocess.run([sys.executable, "-m", "monobatch", "bench", "--dummy-weights", "--shape", "tiny",
                           "-t", "1", "-p", "4", "-n", "2", "-tp", size], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tensor-parallel-size" in lines[0] and words in lines[0], proc.stderr


def test_a_worker_refuses_kv_state_that_differs_from_the_drivers():
    """The replay compares each reserve/adopt_prefix result and the step's block tables with the
    driver's; any difference is an error (the worker then exits and the driver names it)."""
    from monobatch.distributed.runtime import KvSpec, StepMessage, _run
    from monobatch.loader.dummy import dummy_model

    model = dummy_model("tiny", "cpu").model
    plan = TensorParallelPlan.build(model.args, 2)
    shard = shard_model(model, plan, 1, pieces=False, copy_=True)
    spec = KvSpec(True, 2, 16, 64, 4, 16, (0, 0), False)
    kv = spec.build(plan.kv_heads(1), torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="returned False, the driver's True"):
        _run(StepMessage([("reserve", (0, 10_000), True)]), shard, kv, plan, 1, spec, torch.device("cpu"))
    batch = StepBatch.build([(1, [1, 2, 3], 0, True)], "cpu")
    ops = [("reserve", (1, 3), True), ("prepare", (batch,), None)]
    with pytest.raises(RuntimeError, match="block tables differ"):
        _run(StepMessage(ops, batch, {1: [[3]]}), shard, kv, plan, 1, spec, torch.device("cpu"))


def test_warm_up_burst_then_a_request_on_tp2():
    """The server's start-up burst clears the prefix cache on every rank (the workers replay
    clear_prefix_cache), so their block ids keep matching the driver's on the next request."""
    from monobatch.llm import LLM
    from monobatch.loader.dummy import dummy_model

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(1, 40))}]
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32, deterministic=True)
    with LLM(loaded=dummy_model("tiny", "cpu"), tensor_parallel_size=2, **config) as llm:
        llm.scheduler.warm_up(burst=True)
        warm = llm.generate(prompt, params)[0].outputs[0].token_ids
    with LLM(loaded=dummy_model("tiny", "cpu"), **config) as one:  # TP=1 (deterministic: the same bits)
        assert len(warm) == 4 and warm == one.generate(prompt, params)[0].outputs[0].token_ids
