"""The `qjl eval` protocol and a whole run on a tiny random model with a byte-level tokenizer."""

import json

import pytest
import torch

from qjl.tools import evaluate, evalrun
from qjl.integrations.transformers.names import cache_kwargs


@pytest.fixture(scope="module")
def lm():
    import qjl
    from byte_lm import byte_llama, byte_tokenizer

    model, tok = byte_llama(), byte_tokenizer()
    qjl.patch_attention(model)
    return model, tok


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from qjl.tools.texts import load_text

    path = tmp_path_factory.mktemp("texts") / "licenses.txt"
    path.write_text(load_text("licenses")[0][:3000])
    return str(path)


def test_quality_math():
    logp = torch.log_softmax(torch.randn(5, 7), -1)
    targets = torch.tensor([0, 1, 2, 3, 4])
    q = evaluate.quality(logp, targets, logp)
    assert q["kl"] == pytest.approx(0.0, abs=1e-6) and q["top1"] == 1.0
    assert q["ppl"] == pytest.approx(torch.exp(-logp[torch.arange(5), targets].mean()).item(), rel=1e-6)
    other = torch.log_softmax(torch.randn(5, 7), -1)
    kl = (logp.exp() * (logp - other)).sum(-1).mean().item()
    assert evaluate.quality(other, targets, logp)["kl"] == pytest.approx(kl, rel=1e-5)
    with pytest.raises(ValueError, match="targets"):
        evaluate.quality(logp, targets[:3])


def test_block_standard_error_matches_the_spread_of_the_mean():
    """Over many independent samples, the estimated standard error of a mean matches the mean's actual spread --
    also for values correlated within a block, where the per-value formula would understate it 4x."""
    g = torch.Generator().manual_seed(0)
    iid = torch.randn(4000, 512, generator=g, dtype=torch.float64)
    blocky = torch.randn(4000, 32, generator=g, dtype=torch.float64).repeat_interleave(16, 1) + 0.1 * iid
    for x in (iid, blocky):
        true_sd = x.mean(1).std().item()
        est = torch.tensor([evaluate.block_standard_error(r) for r in x[:400]])
        assert abs(est.mean().item() / true_sd - 1) < 0.05
    naive = (blocky.std(1) / 512 ** 0.5).mean().item()
    assert naive < 0.3 * blocky.mean(1).std().item()  # why blocks: the per-token formula is far too small
    assert evaluate.block_standard_error(torch.ones(64)) == 0.0
    import math
    assert math.isnan(evaluate.block_standard_error(torch.randn(31)))
    with pytest.raises(TypeError, match="x must be a tensor"):
        evaluate.block_standard_error([1.0, 2.0])
    with pytest.raises(ValueError, match="x must be 1-d"):
        evaluate.block_standard_error(torch.randn(4, 16))
    with pytest.raises(ValueError, match="block"):
        evaluate.block_standard_error(torch.randn(64), block=0)


def test_quality_reports_the_paired_standard_error():
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(64, 11, generator=g), -1)
    targets = torch.randint(0, 11, (64,), generator=g)
    assert evaluate.quality(ref, targets, ref)["dnll_se"] == 0.0  # paired: the same log-probs differ by nothing
    shifted = torch.log_softmax(ref + 0.3 * torch.randn(64, 11, generator=g), -1)
    q = evaluate.quality(shifted, targets, ref)
    d = -shifted[torch.arange(64), targets] + ref[torch.arange(64), targets]
    assert q["dnll_se"] == pytest.approx(evaluate.block_standard_error(d), rel=1e-9) and q["dnll_se"] > 0
    assert "dnll_se" not in evaluate.quality(shifted, targets)
    with pytest.raises(ValueError, match="reference has shape"):
        evaluate.quality(shifted, targets, ref[:32])


def test_chunked_scoring_with_the_full_cache_equals_one_forward(lm):
    model, _ = lm
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    setup = evaluate.EvalSetup(context=200, score=100, chunk=16)
    logp, _, _ = evaluate.score_method(model, ids, setup, None)
    with torch.no_grad():
        full = torch.log_softmax(model(ids[None, :299]).logits[0, 199:].float(), -1)
    assert logp.shape == (100, 259)
    torch.testing.assert_close(logp, full, atol=2e-5, rtol=0)


def test_compressed_scoring_reads_codes(lm):
    import qjl

    model, _ = lm
    ids = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(0))
    setup = evaluate.EvalSetup(context=300, score=100, chunk=32)
    ref_m, ref = evaluate.evaluate_method(model, ids, setup, None)
    m, _ = evaluate.evaluate_method(model, ids, setup, qjl.QJLConfig.preset("tq-k2v2"), ref)
    assert m["cache"]["compressed_bytes"] > 0 and m["kl"] > 1e-6 and m["top1"] < 1.0
    assert abs(m["ppl"] / ref_m["ppl"] - 1) < 0.5
    with pytest.raises(ValueError, match="setup needs"):
        evaluate.score_method(model, ids[:350], setup, None)
    with pytest.raises(ValueError, match="context"):
        evaluate.EvalSetup(context=0)


def test_text_ids_are_a_stable_prefix(lm, text_file):
    _, tok = lm
    a, meta = evaluate.load_text_ids(tok, text_file, 500)
    b, _ = evaluate.load_text_ids(tok, text_file, 1000)
    assert torch.equal(a, b[:500]) and meta["sha256"]
    with pytest.raises(ValueError, match="needs 100000"):
        evaluate.load_text_ids(tok, text_file, 100000)


def test_a_whole_run(lm, text_file, tmp_path):
    from qjl.tools.report import eval_tables

    short = tmp_path / "short.txt"
    short.write_text("x" * 500)
    plan = evalrun.EvalPlan(methods=("full precision", "tq-k45v3", "tq-k2v2"), texts=(text_file, str(short)),
                            contexts=(300, 600), score=64, chunk=32, passkey_lengths=(96,), passkey_trials=2,
                            memory_tokens=400, threads=1)
    metrics = evalrun.run_eval(plan, tmp_path / "run", show_progress=False, model_and_tokenizer=lm)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["contexts"] == [300, 600] and set(config["methods"]) == set(plan.methods)
    res = saved["results"]
    assert res["full precision"]["texts"][text_file]["300"]["kl"] == 0.0
    assert saved["skipped"] == [{"text": str(short), "context": 600, "reason": "the text has fewer than 664 tokens"}]
    for name in ("tq-k45v3", "tq-k2v2"):
        per = res[name]["texts"]
        worst = res[name]["worst"]["300"]
        assert worst["kl"]["value"] == max(per[t]["300"]["kl"] for t in per)
        assert worst["top1"]["value"] == min(per[t]["300"]["top1"] for t in per)
        worst_text = per[worst["dppl"]["text"]]["300"]
        assert worst["dppl"]["se"] == worst_text["dppl_se"] > 0
        assert worst_text["dppl_se"] == pytest.approx(100 * worst_text["ppl"] / res["full precision"]["texts"][
            worst["dppl"]["text"]]["300"]["ppl"] * worst_text["dnll_se"], rel=1e-12)
        assert res[name]["passkey"]["96"]["trials"] == 2
        assert res[name]["memory_at"]["tokens"] == 400 and res[name]["memory_at"]["x_vs_fp16"] > 0.5
    assert res["tq-k2v2"]["worst"]["300"]["kl"]["value"] > res["tq-k45v3"]["worst"]["300"]["kl"]["value"]
    table = eval_tables(metrics)
    assert "KL@300" in table and "KL@600" in table and "skipped" in table and "tq-k2v2" in table
    assert f"±{res['tq-k2v2']['worst']['300']['dppl']['se']:.2f}" in table
    held = saved["held_out"]
    for name in ("tq-k45v3", "tq-k2v2"):
        per, mean = res[name]["texts"], res[name]["held_mean"]["300"]
        assert mean["texts"] == len(held) == 2
        assert mean["dppl"] == pytest.approx(sum(per[t]["300"]["dppl"] for t in held) / 2, rel=1e-12)
        assert mean["se"] == pytest.approx((sum(per[t]["300"]["dppl_se"] ** 2 for t in held)) ** 0.5 / 2, rel=1e-12)
    assert "mean dppl@300" in table


def test_mean_over_texts():
    per = {"a": {"dppl": 2.0, "dppl_se": 0.6}, "b": {"dppl": -1.0, "dppl_se": 0.8}, "c": {"dppl": 9.0, "dppl_se": 1.0}}
    m = evalrun.mean_over(per, ["a", "b"])
    assert m == {"dppl": 0.5, "se": pytest.approx(0.5), "texts": 2}
    assert evalrun.mean_over(per, []) == {} and evalrun.mean_over({"a": {"dppl": 1.0}}, ["a"]) == {}


def test_plan_is_validated():
    with pytest.raises(ValueError, match="reference"):
        evalrun.EvalPlan(methods=("tq-k45v3",))
    with pytest.raises(ValueError, match="passkey_lengths"):
        evalrun.EvalPlan(methods=("full precision",), passkey_lengths=(10,))
    with pytest.raises(ValueError, match="threads"):
        evalrun.EvalPlan(methods=("full precision",), threads=0)


@pytest.mark.parametrize("name", ["full precision", "tq-k3v2", "kivi-k2v2", "qjl-paper"])
def test_memory_from_captured_kv_equals_memory_through_the_model(lm, name):
    from qjl.tools.methods import make_method

    model, _ = lm
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(0))
    cfg = make_method(name)
    through_model = evaluate.memory_at(model, ids, cfg, 400)
    fed = evaluate.memory_at(model, ids, cfg, 400, kv=evaluate.capture_kv(model, ids, 400))
    # through the model the cache also holds each row's first real position (row_start, read from the attention
    # mask: a few bytes of bookkeeping, counted with the exact part here); everything else is the same storage
    loose = ("bytes", "exact_bytes", "bits_per_value", "x_vs_fp16", "compressed_bits")
    assert {k: v for k, v in fed.items() if k not in loose} == {k: v for k, v in through_model.items() if k not in loose}
    assert abs(fed["compressed_bits"] - through_model["compressed_bits"]) < 0.01
    assert 0 <= through_model["bytes"] - fed["bytes"] == through_model["exact_bytes"] - fed["exact_bytes"] <= 64
    assert fed["bytes"] > 0
    with pytest.raises(ValueError, match="kv holds"):
        evaluate.memory_at(model, ids, cfg, 300, kv=evaluate.capture_kv(model, ids, 400))


@pytest.mark.parametrize("name", ["full precision", "tq-k3v2", "kivi-k2v2", "qjl-paper", "hf-quanto-k4v4"])
def test_memory_from_repeated_keys_equals_memory_from_captured_keys(lm, name):
    """Bytes depend on the token count, not the values: a full-precision cache's keys and values repeated to
    400 tokens give the bytes of 400 captured ones (what ``qjl eval`` uses instead of another prefill)."""
    from qjl.tools.methods import has_quanto, make_cache, make_method

    if name.startswith("hf-") and not has_quanto():
        pytest.skip("needs optimum-quanto")
    model, _ = lm
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1))
    cache = make_cache(model, None)
    model(ids[None], **cache_kwargs(cache), use_cache=True)
    tiled = evaluate.tile_kv(evaluate.held_kv(cache), 400)
    assert [k.shape[-2] for k, _ in tiled] == [400] * len(tiled)
    assert torch.equal(tiled[0][0][..., 150:300, :], cache.layers[0].keys)
    cfg = make_method(name)
    other = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(0))
    captured = evaluate.capture_kv(model, other, 400)
    assert evaluate.memory_at(model, ids, cfg, 400, kv=tiled) == evaluate.memory_at(model, ids, cfg, 400, kv=captured)
    with pytest.raises(ValueError, match="tokens"):
        evaluate.tile_kv(tiled, 0)


def test_a_method_repeats_exactly(lm):
    import qjl

    model, _ = lm
    ids = torch.randint(0, 256, (364,), generator=torch.Generator().manual_seed(2))
    setup = evaluate.EvalSetup(context=300, score=64, chunk=32)
    cfg = qjl.QJLConfig.preset("tq-k3v2")
    a, _, _ = evaluate.score_method(model, ids, setup, cfg)
    b, _, _ = evaluate.score_method(model, ids, setup, cfg)
    assert torch.equal(a, b)


def test_a_run_equals_each_method_on_its_own(lm, text_file, tmp_path):
    """Shared prefills change no number: each method's KL, perplexity, top-1, bytes and passkey hits equal
    those of the method run alone (its own prefill; one ``model.generate`` per passkey prompt).  The prompts
    (700 tokens) are compressed during the prefill."""
    from qjl.tools.methods import REFERENCE, has_quanto, make_cache, make_method
    from qjl.tools.passkey import passkey_prompts

    model, tok = lm
    methods = ("full precision", "tq-k45v3", "tq-k3v2", "qjl-paper", "kivi-k2v2") + (("hf-quanto-k4v4",) if
                                                                                     has_quanto() else ())
    plan = evalrun.EvalPlan(methods=methods, texts=(text_file,), contexts=(700,), score=48, chunk=16,
                            passkey_lengths=(700,), passkey_trials=2, memory_tokens=0, threads=1)
    res = evalrun.run_eval(plan, tmp_path / "run", show_progress=False, model_and_tokenizer=lm)["results"]
    ids, _ = evaluate.load_text_ids(tok, text_file, 748)
    setup = evaluate.EvalSetup(context=700, score=48, chunk=16)
    _, ref = evaluate.evaluate_method(model, ids, setup, None)
    prompts = passkey_prompts(tok, 700, 2)
    for name in methods:
        alone, _ = evaluate.evaluate_method(model, ids, setup, make_method(name), None if name == REFERENCE else ref)
        got = res[name]["texts"][text_file]["700"]
        assert {k: got[k] for k in ("nll", "ppl", "cache")} == {k: alone[k] for k in ("nll", "ppl", "cache")}, name
        if name != REFERENCE:
            assert (got["kl"], got["top1"]) == (alone["kl"], alone["top1"]), name
        hits = sum(key in tok.decode(model.generate(p, **cache_kwargs(make_cache(model, make_method(name))),
                                                    max_new_tokens=12, do_sample=False,
                                                    pad_token_id=tok.eos_token_id)[0, p.shape[1]:])
                   for p, key in prompts)
        assert res[name]["passkey"]["700"]["hits"] == hits, name


def test_segments_pool_the_scored_tokens_of_disjoint_windows(lm, text_file, tmp_path):
    """``segments``: window s of a text starts at s x (context + score) tokens, is prefilled and scored on its own,
    and a text's metrics are those of all its windows' scored tokens together: KL, top-1 and NLL the means of the
    windows' (equal sizes), the standard error from the pooled per-token differences.  A text shorter than the
    windows asked gives as many as it holds (3,000 bytes: 8 windows of 364, 9 asked)."""
    from qjl.tools.methods import make_method

    model, tok = lm
    plan = evalrun.EvalPlan(methods=("full precision", "tq-k3v2"), texts=(text_file,), contexts=(300,), score=64,
                            chunk=32, passkey_trials=0, memory_tokens=0, threads=1, segments=9)
    got = evalrun.run_eval(plan, tmp_path / "run", show_progress=False, model_and_tokenizer=lm)["results"]
    m, ref_m = got["tq-k3v2"]["texts"][text_file]["300"], got["full precision"]["texts"][text_file]["300"]
    assert m["segments"] == ref_m["segments"] == 8
    ids, _ = evaluate.load_text_ids(tok, text_file, 8 * 364)
    setup = evaluate.EvalSetup(context=300, score=64, chunk=32)
    per, diffs = [], []
    for s in range(8):
        w = ids[s * 364: (s + 1) * 364]
        ref, _, _ = evaluate.score_method(model, w, setup, None)
        logp, _, _ = evaluate.score_method(model, w, setup, make_method("tq-k3v2"))
        per.append(evaluate.quality(logp, w[300:], ref))
        t = w[300:].unsqueeze(1)
        diffs.append(ref.gather(1, t)[:, 0] - logp.gather(1, t)[:, 0])
    assert len({round(q["kl"], 9) for q in per}) == 8  # the windows differ
    for key in ("kl", "top1", "nll"):
        assert m[key] == pytest.approx(sum(q[key] for q in per) / 8, rel=1e-5), key
    assert m["dnll_se"] == pytest.approx(evaluate.block_standard_error(torch.cat(diffs)), rel=1e-5)
    assert m["dnll_se"] < max(q["dnll_se"] for q in per)
    with pytest.raises(ValueError, match="segments"):
        evalrun.EvalPlan(methods=("full precision",), segments=0)


def test_token_columns_refuse_bad_input():
    logp = torch.log_softmax(torch.randn(4, 6), -1)
    cols = evaluate.token_quality(logp, torch.tensor([0, 1, 2, 3]), logp)
    assert evaluate.summarize_tokens(cols)["kl"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="targets"):
        evaluate.token_quality(logp, torch.tensor([[0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="reference"):
        evaluate.token_quality(logp, torch.tensor([0, 1, 2, 3]), logp[:2])
    with pytest.raises(ValueError, match="cols"):
        evaluate.summarize_tokens({"kl": cols["kl"]})
    with pytest.raises(ValueError, match="top1"):
        evaluate.summarize_tokens({"nll": cols["nll"], "kl": cols["kl"]})
    with pytest.raises(ValueError, match="no scored tokens"):
        evaluate.summarize_tokens({"nll": cols["nll"][:0]})
    with pytest.raises(ValueError, match="unequal"):
        evaluate.summarize_tokens({**cols, "top1": cols["top1"][:2]})
    with pytest.raises(ValueError, match="fed"):
        evaluate.measure_tokens(cols, None, 1.0, -1)


def test_over_seeds_means_the_worst_held_out_text():
    def run(kls, dppls, top1s):
        texts = {t: {"512": {"kl": k, "dppl": p, "top1": a}} for t, k, p, a in zip("ab", kls, dppls, top1s)}
        return {"texts": texts, "worst": {"512": evalrun.worst_over({t: v["512"] for t, v in texts.items()}, ["a", "b"])}}

    runs = [run([0.01, 0.02], [1.0, -1.0], [0.9, 0.95]), run([0.03, 0.01], [0.5, 2.0], [0.97, 0.93])]
    got = evalrun.over_seeds(runs, ["a", "b"])["512"]
    assert got["seeds"] == 2 and got["kl"] == pytest.approx(0.025) and got["kl_max"] == 0.03
    assert got["dppl"] == pytest.approx(1.5) and got["top1"] == pytest.approx(0.915)
    assert got["kl_mean"] == pytest.approx(0.0175)


def test_a_preset_built_with_auto_is_measured_through_the_model(lm, text_file, tmp_path, monkeypatch):
    """The bytes at ``memory_tokens`` of a configuration that allocates widths from the prompt's queries come from a
    run of the model whatever its name (a preset built with ``QJLConfig.auto``, not only ``auto-*``): the same bytes
    as the ``auto-3.0`` it equals, and a compressed cache (fed keys without queries it would hold every token exact)."""
    from qjl.cache import presets
    from qjl.cache.config import QJLConfig

    monkeypatch.setitem(presets.PRESETS, "x-auto", QJLConfig.auto(bits_per_value=3.0))
    plan = evalrun.EvalPlan(methods=("full precision", "x-auto", "auto-3.0"), texts=(text_file,), contexts=(300,),
                            score=32, chunk=32, passkey_lengths=(96,), passkey_trials=0, memory_tokens=400, threads=1)
    res = evalrun.run_eval(plan, tmp_path / "run", show_progress=False, model_and_tokenizer=lm)["results"]
    assert res["x-auto"]["memory_at"] == res["auto-3.0"]["memory_at"]
    assert res["x-auto"]["memory_at"]["x_vs_fp16"] > 1.5
