"""`vllm-trn gate`: its metrics against independent float64 computations (torch) and hand-computed cases, and the
whole command on small random AFMoE / MLA-Trinity models: it passes the exact conversion, measures a reduced-rank
conversion's loss (whitened SVD + refit below plain SVD) and fails a threshold set under it, fails a broken
candidate naming the metric, gates two `vllm-trn serve` processes over HTTP, and refuses bad input with exit 2 and
no report.

References: transformers' `AfmoeForCausalLM` (tests/references/afmoe.py), torch float64 math."""

from __future__ import annotations

import json
import math
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.references.afmoe import convert_to_mla, make_random_afmoe
from vllm_trn_plugin.bench.local import free_port
from vllm_trn_plugin.gate import inputs, passkey
from vllm_trn_plugin.gate.cli import EXIT_ERROR, EXIT_FAIL, EXIT_PASS
from vllm_trn_plugin.gate.cli import main as gate
from vllm_trn_plugin.gate.errors import GateError
from vllm_trn_plugin.gate.metrics import (
    Accumulator,
    Scores,
    Thresholds,
    centred_cosine,
    judge,
    paired,
    scores_from_logits,
    topk_agreement,
)
from vllm_trn_plugin.gate.run import GateOptions, plan_buckets, run_gate
from vllm_trn_plugin.gate.sources import TransformersSource
from vllm_trn_plugin.tools.convert_mla import convert_mla

FULL_LAYER = 3
SMALL = dict(hidden_size=256, intermediate_size=512, sliding_window=32)  # windows of 512 cross the sliding window
BUCKETS = "0,128,512"
PASSKEY = ["--passkey-lengths", "300,500", "--passkey-depths", "10,90", "--decode-context", "200"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small models: a second OpenMP thread mostly waits


# ---- metrics against float64 ------------------------------------------------------------------------------------


def _random_logits(n: int, v: int, seed: int, scale: float = 3.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, scale, (n, v))


def test_accumulator_equals_float64_torch() -> None:
    """Per-bucket NLL, perplexity, agreement (near-ties apart), full-logit centred cosine and KL of two chunks equal
    torch float64 computed over all positions at once."""
    n, v = 300, 50
    ref = _random_logits(n, v, 0)
    cand = ref + _random_logits(n, v, 1, 0.3)
    # Plant near-ties in the reference at every 10th position: top-2 within 1e-4 nats.
    top2 = np.argsort(-ref, 1)[:, :2]
    rows = np.arange(0, n, 10)
    ref[rows, top2[rows, 1]] = ref[rows, top2[rows, 0]] - 1e-4
    cand = cand - 7.0  # a constant shift (logits vs log-probabilities) changes nothing
    targets = np.random.default_rng(2).integers(0, v, n)
    pos = np.arange(1, n + 1)
    acc = Accumulator([0, 100, 301], 1e-3, True)
    for a, b in ((0, 137), (137, n)):  # chunked: the sums must not depend on where chunks end
        acc.add(
            scores_from_logits(pos[a:b], targets[a:b], ref[a:b], 5),
            scores_from_logits(pos[a:b], targets[a:b], cand[a:b], 5),
        )
    r, c = torch.tensor(ref), torch.tensor(cand)
    lr, lc = torch.log_softmax(r, -1), torch.log_softmax(c, -1)
    t = torch.tensor(targets)
    nll_r, nll_c = -lr.gather(1, t[:, None])[:, 0], -lc.gather(1, t[:, None])[:, 0]
    cos = torch.nn.functional.cosine_similarity(r - r.mean(1, keepdim=True), c - c.mean(1, keepdim=True), dim=1)
    kl = (lr.exp() * (lr - lc)).sum(1)
    srt = torch.sort(lr, 1, descending=True).values
    tie = (srt[:, 0] - srt[:, 1]) < 1e-3
    agree = r.argmax(1) == c.argmax(1)
    for b, (lo, hi) in zip(acc.buckets, [(0, 100), (100, 301)]):
        m = torch.tensor((pos >= lo) & (pos < hi))
        s = b.summary()
        assert s["positions"] == int(m.sum())
        assert s["nll_reference"] == pytest.approx(float(nll_r[m].mean()), abs=1e-12)
        assert s["nll_diff"] == pytest.approx(float((nll_c - nll_r)[m].mean()), abs=1e-12)
        assert s["nll_diff_stderr"] == pytest.approx(
            float((nll_c - nll_r)[m].std(unbiased=False)) / math.sqrt(int(m.sum())), rel=1e-9
        )
        assert s["ppl_candidate"] == pytest.approx(math.exp(float(nll_c[m].mean())), rel=1e-12)
        assert s["ties"] == int((m & tie).sum()) > 0
        assert s["compared"] == int((m & ~tie).sum())
        assert s["agreement"] == pytest.approx(float((m & ~tie & agree).sum()) / int((m & ~tie).sum()))
        assert s["cosine_mean"] == pytest.approx(float(cos[m].mean()), abs=1e-12)
        assert s["cosine_min"] == pytest.approx(float(cos[m].min()), abs=1e-12)
        assert s["kl_mean"] == pytest.approx(float(kl[m].mean()), abs=1e-12)
    assert 0.5 < acc.total().summary()["agreement"] < 1.0  # the noise flips some argmaxes: the count is tested


def test_topk_support_by_hand() -> None:
    """Top-3 sets {1, 2, 3} and {2, 3, 4}: cosine and KL on the shared {2, 3}, worked by hand."""
    ref = Scores(np.array([1]), np.array([-1.0]), np.array([[1, 2, 3]]), np.array([[-0.5, -1.0, -2.0]]))
    cand = Scores(np.array([1]), np.array([-1.0]), np.array([[2, 4, 3]]), np.array([[-0.7, -1.1, -1.5]]))
    cos, kl, size = topk_agreement(ref, cand)
    assert size[0] == 2
    # centred on {2, 3}: ref (-1, -2) -> (0.5, -0.5), cand (-0.7, -1.5) -> (0.4, -0.4): cosine 1
    assert cos[0] == pytest.approx(1.0)
    p = np.exp([-1.0, -2.0]) / np.exp([-1.0, -2.0]).sum()
    q = np.exp([-0.7, -1.5]) / np.exp([-0.7, -1.5]).sum()
    assert kl[0] == pytest.approx(float((p * np.log(p / q)).sum()), abs=1e-12)
    lone = Scores(np.array([1]), np.array([-1.0]), np.array([[9, 8, 7]]), np.array([[-0.1, -2.0, -3.0]]))
    cos, kl, size = topk_agreement(ref, lone)
    assert size[0] == 0 and math.isnan(cos[0]) and math.isnan(kl[0])  # nothing shared: not counted


def test_centred_cosine_ignores_shift_not_scale_error() -> None:
    x = _random_logits(4, 30, 3)
    assert np.allclose(centred_cosine(x, x - 5.0), 1.0)
    lp = x - np.log(np.exp(x).sum(1, keepdims=True))
    assert np.allclose(centred_cosine(x, lp), 1.0)  # logits against log-probabilities
    assert (centred_cosine(x, x + _random_logits(4, 30, 4, 1.0)) < 0.99).all()


def test_paired_cuts_both_sides_to_common_stretches() -> None:
    def chunks(cuts: list[int]) -> list[Scores]:
        s = scores_from_logits(np.arange(1, 21), np.zeros(20, dtype=int), _random_logits(20, 6, 5), 3)
        return [s.slice(a, b) for a, b in zip(cuts, cuts[1:])]

    pairs = list(paired(iter(chunks([0, 7, 20])), iter(chunks([0, 3, 12, 20]))))
    assert [p[0].positions.tolist() for p in pairs] == [p[1].positions.tolist() for p in pairs]
    assert [len(p[0]) for p in pairs] == [3, 4, 5, 8]
    with pytest.raises(GateError, match="different number of positions"):
        list(paired(iter(chunks([0, 20])), iter(chunks([0, 12]))))


def test_judge_names_metric_value_threshold_and_bucket() -> None:
    s = {
        "bucket": "2k-8k",
        "positions": 100,
        "compared": 90,
        "agreement": 0.9,
        "nll_diff": -0.02,
        "cosine_mean": 0.98,
        "kl_mean": 0.2,
    }
    fails = judge(s, Thresholds(), full=False)
    assert fails == [
        "next-token agreement 0.9000 < 0.99 (bucket 2k-8k, 90 positions outside near-ties)",
        "NLL difference -0.0200 nats exceeds +-0.01 (bucket 2k-8k)",
        "top-k logit cosine 0.98000 < 0.99 (bucket 2k-8k)",
        "top-k support KL 0.2 nats > 0.01 (bucket 2k-8k)",
    ]
    ok = {**s, "agreement": 0.995, "nll_diff": 0.004, "cosine_mean": 0.9995, "kl_mean": 0.001}
    assert judge(ok, Thresholds(), full=True) == []


def test_judge_fails_every_nan_metric() -> None:
    """A NaN compares False with anything: each metric that is NaN must fail, not pass by default."""
    s = {"bucket": "0-2k", "positions": 10, "compared": 10, "agreement": 1.0, "nll_diff": 0.0, "cosine_mean": 1.0}
    s["kl_mean"] = 0.0
    assert judge(s, Thresholds(), full=True) == []
    for key in ("agreement", "nll_diff", "cosine_mean", "kl_mean"):
        fails = judge({**s, key: math.nan}, Thresholds(), full=True)
        assert len(fails) == 1 and "nan" in fails[0], (key, fails)


def test_plan_buckets() -> None:
    assert plan_buckets([0, 2048, 8192, 32768], 4095, 4095, "t") == (
        [0, 2048, 4095],
        ["buckets cut at 4095 tokens: the window (what both models allow, or --window)"],
    )
    with pytest.raises(GateError, match=r"t: too short for bucket 2048-4095: .* 1000 tokens"):
        plan_buckets([0, 2048, 8192], 4095, 1000, "t")


# ---- passkey and input --------------------------------------------------------------------------------------------


def _byte_encode(text: str) -> list[int]:
    return list(text.encode())


def test_passkey_prompt_has_the_length_and_the_key_at_its_depth() -> None:
    for length, depth in ((400, 0.1), (400, 0.9), (1000, 0.5)):
        ids = passkey.build_prompt(_byte_encode, length, depth, "31415")
        assert len(ids) == length
        text = bytes(ids).decode()
        assert text.startswith(passkey.INTRO) and text.endswith(passkey.QUESTION)
        needle = passkey.NEEDLE.format(key="31415")
        room = length - len(passkey.INTRO) - len(needle) - len(passkey.QUESTION)
        assert text.index("31415") == len(passkey.INTRO) + round(depth * room) + needle.index("31415")
    assert passkey.retrieved(" 31415. Remember", "31415")
    assert not passkey.retrieved(" 3141 5", "31415")
    assert not passkey.retrieved(" 314159", "31415")
    assert not passkey.retrieved("no digits", "31415")
    assert passkey.fitting_lengths([2048, 8192, 14336, 32768], 4084) == ([2048, 4084], [8192, 14336, 32768])
    with pytest.raises(GateError, match="cannot hold the passkey prompt"):
        passkey.build_prompt(_byte_encode, 100, 0.5, "31415")


def test_text_is_tokenized_in_pieces_like_the_whole(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Streaming in pieces (cut at whitespace) gives the ids of the whole text; windows cut it without overlap."""
    f = tmp_path / "t.txt"
    text = " ".join(f"w{i} é\nx" for i in range(500))
    f.write_text(text)
    monkeypatch.setattr(inputs, "TEXT_PIECE_CHARS", 97)
    t = inputs.TokenInput(str(f), None, _byte_encode)
    assert t.total == len(text.encode()) and list(t.ids()) == _byte_encode(text)
    wins = list(t.windows(1000))
    assert [len(w) for w in wins] == t.window_lengths(1000) and sum(wins, []) == _byte_encode(text)
    assert inputs.TokenInput(str(f), None, _byte_encode, max_tokens=1500).window_lengths(1000) == [1000, 500]
    (tmp_path / "t.json").write_text(json.dumps([1.5, 2]))
    with pytest.raises(GateError, match="t.json: expected a flat list of integer token ids"):
        inputs.TokenInput(None, str(tmp_path / "t.json"), _byte_encode)


def test_text_without_whitespace_is_cut_by_length(tmp_path: Path) -> None:
    """A text with no whitespace (CJK, minified JSON) is cut into pieces of at most TEXT_PIECE_CHARS characters
    that put together give the text back; text with whitespace is still cut at whitespace."""
    bound = inputs.TEXT_PIECE_CHARS
    rng = np.random.default_rng(0)
    cjk = "".join(map(chr, rng.integers(0x4E00, 0x9FFF, 200_000))) + "\U0001f600" * 10  # and some non-BMP
    for text in (cjk, "a " + cjk, cjk + " end"):
        f = tmp_path / "cjk.txt"
        f.write_text(text, encoding="utf-8")
        pieces = list(inputs._text_pieces(f))
        assert "".join(pieces) == text
        assert max(map(len, pieces)) <= bound and len(pieces) <= -(-len(text) // bound) + 2
    ordinary = " ".join(f"word{i}" for i in range(60_000))
    f = tmp_path / "plain.txt"
    f.write_text(ordinary)
    pieces = list(inputs._text_pieces(f))
    assert "".join(pieces) == ordinary and len(pieces) > 1 and max(map(len, pieces)) <= bound
    assert all(p[0] == " " for p in pieces[1:])  # every cut falls just before a space


# ---- small models -------------------------------------------------------------------------------------------------


def _text(path: Path, words: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text(" ".join("".join(chr(c) for c in rng.integers(97, 123, rng.integers(2, 9))) for _ in range(words)))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random AFMoE whose full layer's [k_proj; v_proj] has rank 256, its exact MLA conversion, and a text of
    about 2500 byte tokens."""
    root = tmp_path_factory.mktemp("gate")
    orig = make_random_afmoe(root / "orig", seed=3, full_kv_rank=256, **SMALL)
    return {
        "orig": orig,
        "mla": convert_to_mla(orig, root / "mla", kv_lora_rank=256),
        "text": _text(root / "t.txt", 450),
    }


def _gate(ref: str, cand: str, text: Path, out: Path | None, *extra: str) -> tuple[int, dict | None]:
    argv = ["--reference", ref, "--candidate", cand, "--text", str(text), "--buckets", BUCKETS, *PASSKEY, "--quiet"]
    argv += ["--out", str(out)] if out else []
    rc = gate(argv + list(extra))
    report = json.loads((out / "gate.json").read_text()) if out and (out / "gate.json").exists() else None
    return rc, report


def test_chunked_prefill_scores_equal_one_forward(models: dict[str, Path]) -> None:
    """The transformers side prefills through its KV cache 40 tokens at a time (across the 32-token sliding window):
    the same log-probabilities as one forward over the window."""
    src = TransformersSource("reference", str(models["orig"]))
    tokens = src.encode(models["text"].read_text()[:300])
    chunks = list(src.score(tokens, 5, 40))
    with torch.no_grad():
        want = torch.log_softmax(src.model(input_ids=torch.tensor([tokens])).logits[0].double(), -1)
    got = np.concatenate([c.target for c in chunks])
    ref = want[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    assert np.concatenate([c.positions for c in chunks]).tolist() == list(range(1, len(tokens)))
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()


def test_exact_rank_conversion_passes(models: dict[str, Path], tmp_path: Path) -> None:
    """The exact-rank MLA conversion (read as its dense equivalent) against transformers' original: pass, every
    position agrees, the NLL difference at float32 noise, full-logit cosine 1."""
    rc, rep = _gate(f"transformers:{models['orig']}", f"transformers:{models['mla']}", models["text"], tmp_path)
    assert rc == EXIT_PASS and rep["verdict"] == "pass", rep["failures"]
    o = rep["overall"]
    print(f"\nexact rank: agreement {o['agreement']}, NLL diff {o['nll_diff']:.2e}, cosine {o['cosine_mean']:.9f}")
    assert rep["full_logits"] and rep["logit_metric"].startswith("full-logit")
    assert o["agreement"] == 1.0 and o["positions"] == rep["text"]["tokens"] - rep["text"]["windows"]
    assert abs(o["nll_diff"]) < 1e-5 and o["cosine_mean"] > 1 - 1e-9 and o["kl_mean"] < 1e-9
    assert [b["bucket"] for b in rep["buckets"]] == ["0-128", "128-512"]
    assert (tmp_path / "gate.txt").read_text().rstrip().endswith("PASS") and (tmp_path / "gate.png").is_file()


@pytest.fixture(scope="module")
def anisotropic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As tests/test_convert_mla.py: a full-rank random AFMoE whose full layer's input norm spreads channels over
    ~e^+-2 (real activations' outlier channels, what whitening exists for)."""
    ckpt = make_random_afmoe(tmp_path_factory.mktemp("aniso") / "orig", seed=1, **SMALL)
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    g = torch.Generator().manual_seed(5)
    t[f"model.layers.{FULL_LAYER}.input_layernorm.weight"] = torch.exp(torch.randn(SMALL["hidden_size"], generator=g))
    save_file(t, str(f), {"format": "pt"})
    return ckpt


def test_reduced_rank_loss_measured_and_gated(anisotropic: Path, models: dict[str, Path], tmp_path: Path) -> None:
    """At latent 64: the gate measures the conversion's loss, lower for convert-mla's whitened SVD + refit than for a
    plain SVD, and fails a KL threshold set under the measured loss, naming it."""
    calib = torch.randint(0, 256, (16, 128), generator=torch.Generator().manual_seed(7))
    ours = convert_mla(anisotropic, tmp_path / "w64", latent=64, calib=calib, progress=False).dst
    plain = convert_to_mla(anisotropic, tmp_path / "p64", kv_lora_rank=64)
    text, ref = models["text"], f"transformers:{anisotropic}"
    measured = {}
    for name, ckpt in (("whitened", ours), ("plain", plain)):
        rc, rep = _gate(ref, f"transformers:{ckpt}", text, tmp_path / name, "--no-passkey")
        measured[name] = rep["overall"]
        assert rc in (EXIT_PASS, EXIT_FAIL) and rep["verdict"] == ("pass" if rc == EXIT_PASS else "fail")
    w, p = measured["whitened"], measured["plain"]
    print(
        f"\nlatent 64, whitened+refit / plain SVD: KL {w['kl_mean']:.3e} / {p['kl_mean']:.3e}, "
        f"|NLL diff| {abs(w['nll_diff']):.3e} / {abs(p['nll_diff']):.3e}, agreement {w['agreement']:.4f} / "
        f"{p['agreement']:.4f}, cosine {w['cosine_mean']:.6f} / {p['cosine_mean']:.6f}"
    )
    assert 0 < w["kl_mean"] < p["kl_mean"] and w["cosine_mean"] > p["cosine_mean"]
    # Thresholds around the measured loss decide: every other check loosened, KL at twice the loss passes and at
    # half of it fails, the failures naming only the KL.
    loose = ["--no-passkey", "--min-agreement", "0.5", "--min-cosine", "0.9", "--max-nll-diff", "0.1"]
    cand = f"transformers:{ours}"
    rc, rep = _gate(ref, cand, text, tmp_path / "loose", *loose, "--max-kl", f"{2 * w['kl_mean']:.4e}")
    assert rc == EXIT_PASS and rep["verdict"] == "pass", rep["failures"]
    tight = f"{w['kl_mean'] / 2:.4e}"
    rc, rep = _gate(ref, cand, text, tmp_path / "tight", *loose, "--max-kl", tight)
    assert rc == EXIT_FAIL and rep["verdict"] == "fail"
    assert rep["failures"] and all(f.startswith("full KL") and f"> {float(tight)}" in f for f in rep["failures"])


def test_broken_candidate_fails_naming_the_metric(models: dict[str, Path], tmp_path: Path) -> None:
    """The exact conversion with its full layer's per-key norm scale dropped (k_norm weight 1): fails, and the
    failures name the metrics that caught it."""
    broken = tmp_path / "broken"
    shutil.copytree(models["mla"], broken)
    t = load_file(str(broken / "model.safetensors"))
    name = f"model.layers.{FULL_LAYER}.self_attn.k_norm.weight"
    t[name] = torch.ones_like(t[name])
    save_file(t, str(broken / "model.safetensors"), {"format": "pt"})
    rc, rep = _gate(f"transformers:{models['orig']}", f"transformers:{broken}", models["text"], tmp_path / "o")
    print("\nbroken k_norm:", *rep["failures"], sep="\n  ")
    assert rc == EXIT_FAIL and rep["verdict"] == "fail"
    # One layer of four loses its key scale: the argmax moves at ~2% of the positions, which the agreement
    # threshold catches (in every bucket); the cosine and KL move too, measurably but within their defaults.
    prefill = [f for f in rep["failures"] if "bucket decode" not in f]
    assert [f.split(" 0.")[0] for f in prefill] == ["next-token agreement"] * 3
    assert all(f"bucket {b}" in f for b, f in zip(["0-128", "128-512", "all"], prefill))
    o = rep["overall"]
    assert o["cosine_mean"] < 1 - 1e-5 and o["kl_mean"] > 1e-4


class _NaNLogitsEvery400(TransformersSource):
    """transformers on the exact conversion, with NaN logits at every position whose context length is a multiple of
    400 (1 in 400): what a kernel writing an uninitialised or overflowed row looks like."""

    def __init__(self, label: str, path: str) -> None:
        super().__init__(label, path)
        self.poisoned: list[int] = []

    def score(self, tokens: list[int], top_k: int, chunk: int) -> Iterator[Scores]:
        for s in super().score(tokens, top_k, chunk):
            logits = s.logits.copy()
            rows = np.nonzero(s.positions % 400 == 0)[0]
            logits[rows] = np.nan
            self.poisoned += [int(p) for p in s.positions[rows]]
            yield scores_from_logits(s.positions, np.asarray(tokens)[s.positions], logits, top_k)


def test_nan_logits_fail_naming_the_positions(models: dict[str, Path]) -> None:
    """NaN logits at 1 in 400 positions fail the gate, naming window and position of each, while every other metric
    stays measured over the finite positions (no NaN spreads into the sums)."""
    ref = TransformersSource("reference", str(models["orig"]))
    cand = _NaNLogitsEvery400("candidate", str(models["mla"]))
    opts = GateOptions(text=str(models["text"]), buckets=[0, 128, 512], passkey=False, decode_prompts=0, progress=False)
    rep = run_gate(ref, cand, opts)
    print("\nNaN logits:", *rep["failures"], sep="\n  ")
    o = rep["overall"]
    assert cand.poisoned and rep["verdict"] == "fail", rep["failures"]
    assert o["nonfinite"] == len(cand.poisoned)
    assert [f.split(" at ")[0] for f in rep["failures"]] == ["non-finite logits, log-probabilities or metrics"] * 2
    assert "(bucket 128-512): window 1 position 400" in rep["failures"][0] and "(bucket all)" in rep["failures"][1]
    assert o["agreement"] == 1.0 and abs(o["nll_diff"]) < 1e-5 and o["cosine_mean"] > 1 - 1e-9


class _KeyScaleDroppedInDecode(TransformersSource):
    """transformers on the exact conversion whose decode steps (one new token against the cache) lose the full
    layer's per-key norm scale, while prefill keeps it: the absorbed latent decode folds that scale into the query
    (q . (k_hat * w) = (q * w) . k_hat: the full layer has no RoPE), so dropping it there scores every cached key as
    q . k_hat. Emulated on the real model by dividing the decode queries by w."""

    def __init__(self, label: str, path: str) -> None:
        super().__init__(label, path)
        attn = self.model.model.layers[FULL_LAYER].self_attn
        w = attn.k_norm.weight.detach().clone()

        def drop_key_scale_in_decode(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return out / w if out.shape[1] == 1 else out  # [batch, tokens, heads, head_dim]

        attn.q_norm.register_forward_hook(drop_key_scale_in_decode)


def test_decode_only_bug_fails_on_decode(models: dict[str, Path]) -> None:
    """A bug only the decode path has: every teacher-forced (prefill) bucket passes exactly, and the gate fails on
    the decode check, naming it."""
    ref = TransformersSource("reference", str(models["orig"]))
    cand = _KeyScaleDroppedInDecode("candidate", str(models["mla"]))
    opts = GateOptions(
        text=str(models["text"]),
        buckets=[0, 128, 512],
        passkey=False,
        decode_prompts=8,
        decode_context=200,
        progress=False,
    )
    rep = run_gate(ref, cand, opts)
    d = rep["decode"]
    print(f"\ndecode-only bug: {rep['failures']} {d}")
    assert rep["overall"]["agreement"] == 1.0 and abs(rep["overall"]["nll_diff"]) < 1e-5
    assert rep["verdict"] == "fail" and rep["failures"] and all("(bucket decode" in f for f in rep["failures"])
    assert d["positions"] == 8 * 64 and d["agreement"] < 0.99
    clean = run_gate(ref, TransformersSource("candidate", str(models["mla"])), opts)
    assert clean["verdict"] == "pass" and clean["decode"]["agreement"] == 1.0, clean["failures"]


# ---- bad input: exit 2, a clear message, no report ------------------------------------------------------------


class _NoPromptLogprobs(BaseHTTPRequestHandler):
    """An OpenAI-compatible server (as many non-vLLM ones are) that ignores `prompt_logprobs`."""

    def _send(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._send({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self._send({"tokens": list(req["prompt"].encode()), "count": 0, "max_model_len": 4096})
        else:
            self._send({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    def log_message(self, *args: object) -> None:
        pass


def _bad(capsys: pytest.CaptureFixture, out: Path, argv: list[str], *match: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gate.json").write_text('{"verdict": "pass"}')  # a stale report from an earlier run
    rc = gate([*argv, "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR, err
    assert "vllm-trn gate: error:" in err and all(m in err for m in match) and "Traceback" not in err, err
    assert not (out / "gate.json").exists()


def test_bad_input_is_a_clear_error(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    orig, text = f"transformers:{models['orig']}", str(models["text"])
    common = ["--buckets", BUCKETS, *PASSKEY]
    url = f"http://127.0.0.1:{free_port()}"
    argv = ["--reference", orig, "--candidate", url, "--text", text, *common]
    _bad(capsys, tmp_path / "a", argv, f"candidate endpoint {url}/v1/models: unreachable")

    other = tmp_path / "other-tokenizer"
    shutil.copytree(models["mla"], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    argv = ["--reference", orig, "--candidate", f"transformers:{other}", "--text", text, *common]
    _bad(capsys, tmp_path / "b", argv, "tokenizer mismatch")

    short = _text(tmp_path / "short.txt", 20)
    argv = ["--reference", orig, "--candidate", f"transformers:{models['mla']}", "--text", str(short), *common]
    _bad(capsys, tmp_path / "c", argv, "short.txt: too short for bucket 128-512")
    _bad(capsys, tmp_path / "c", [*argv[:4], "--text", str(tmp_path / "none.txt")], "none.txt: no such file")

    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoPromptLogprobs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = ["--reference", url, "--candidate", orig, "--text", text, *common]
        _bad(capsys, tmp_path / "d", argv, "carries no prompt_logprobs")
    finally:
        server.shutdown()


# ---- vLLM ---------------------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_serves_the_exact_conversion_within_the_gate(models: dict[str, Path], tmp_path: Path) -> None:
    """The plugin's MLA-Trinity model in vLLM (in process, float32) on the exact conversion against transformers'
    original: passes with the full-logit metrics (vocabulary 259), every position outside near-ties agreeing."""
    rc, rep = _gate(f"transformers:{models['orig']}", f"vllm:{models['mla']}", models["text"], tmp_path)
    o = rep["overall"]
    print(f"\nvLLM exact rank: agreement {o['agreement']}, NLL diff {o['nll_diff']:.2e}, cosine {o['cosine_mean']}")
    assert rc == EXIT_PASS, rep["failures"]
    assert rep["candidate"]["kind"] == "vllm" and rep["full_logits"]
    assert o["agreement"] == 1.0 and abs(o["nll_diff"]) < 1e-4 and o["cosine_mean"] > 1 - 1e-6
    assert rep["passkey"]["same_text"] == len(rep["passkey"]["cells"])


@pytest.mark.vllm
def test_two_endpoints_over_http(servers, tmp_path: Path) -> None:  # noqa: ANN001
    """Two `vllm-trn serve` processes of the demo MLA-Trinity (float32 and bfloat16) gated over HTTP: the float32
    server against itself passes exactly (top-k support); the bf16 one against it is measured, its difference real
    but small, and the verdict follows the thresholds."""
    f32, bf16 = servers.get("mla-trinity", "float32"), servers.get("mla-trinity", "bfloat16")
    # 2600 of the text's ~5000 byte tokens: one window filling 0-2k and 600 positions of 2k-4095 (max-model-len
    # 4096); two passkeys and two short continuations: the HTTP path of every part of a run, at CI's size.
    text = _text(tmp_path / "t.txt", 900)
    pk = ["--max-tokens", "2600", "--passkey-lengths", "1024", "--passkey-depths", "10,90", "--quiet"]
    pk += ["--decode-prompts", "2", "--decode-context", "512", "--decode-tokens", "32"]
    rc = gate(["--reference", f32.url, "--candidate", f32.url, "--text", str(text), *pk, "--out", str(tmp_path / "s")])
    same = json.loads((tmp_path / "s" / "gate.json").read_text())
    assert rc == EXIT_PASS and not same["full_logits"] and same["logit_metric"].startswith("top-20")
    assert [b["bucket"] for b in same["buckets"]] == ["0-2k", "2k-4095"]
    # The two requests may share a batch (other shapes, other rounding): float32 noise, no more.
    assert same["overall"]["agreement"] == 1.0 and abs(same["overall"]["nll_diff"]) < 1e-4
    assert same["passkey"]["same_text"] == 2

    rc = gate(["--reference", f32.url, "--candidate", bf16.url, "--text", str(text), *pk, "--out", str(tmp_path / "b")])
    rep = json.loads((tmp_path / "b" / "gate.json").read_text())
    o = rep["overall"]
    print(
        f"\nbf16 vs float32 server: agreement {o['agreement']:.4f} ({o['ties']} ties), NLL diff {o['nll_diff']:+.2e}"
        f" +- {o['nll_diff_stderr']:.1e}, top-k cosine {o['cosine_mean']:.5f}, KL {o['kl_mean']:.2e}; "
        f"{rep['verdict']}: {rep['failures']}"
    )
    assert o["nll_diff"] != 0.0 and abs(o["nll_diff"]) < 0.1 and o["agreement"] > 0.8
    assert rc == (EXIT_PASS if not rep["failures"] else EXIT_FAIL)


def test_gate_options_defaults_match_the_docs() -> None:
    """docs/gate.md states the defaults; they are these."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "gate.md").read_text()
    th, opts = Thresholds(), GateOptions()
    for flag, value in [
        ("--min-agreement", th.min_agreement),
        ("--max-nll-diff", th.max_nll_diff),
        ("--min-cosine", th.min_cosine),
        ("--min-topk-cosine", th.min_topk_cosine),
        ("--max-kl", th.max_kl),
        ("--max-passkey-misses", th.max_passkey_misses),
        ("--top-k", opts.top_k),
        ("--tie-margin", opts.tie_margin),
    ]:
        assert f"`{flag}` | {value}" in doc, flag
    _ = run_gate  # the API docs/gate.md names
