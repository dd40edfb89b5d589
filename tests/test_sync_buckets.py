"""The user's sync in buckets (`--loop bucket_mb`, issue 44): the merged weights handed over bucket by bucket, each an
in-place reload of the engine; the modules the engine packs whose parts went over apart; fault `bucket-lost`."""

from pathlib import Path

import pytest

from lora_parity.evidence.receipt import AdapterVersion, Check, Receipt, Verdict, sha256_json
from lora_parity.models import buckets
from lora_parity.models.config import ModelConfig, load
from lora_parity.models.loop import LoopSpec, merged, parse
from lora_parity.run.runner import RunOptions, execute
from lora_parity.run.selftest import selftest
from lora_parity.util.errors import ConfigError
from lora_parity.verdict import findings, lifecycle
from lora_parity.verdict.verify import verify

ROW = "the user's sync in buckets"


class Sized:
    """A stand-in tensor of `n` bytes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


@pytest.mark.unit
def test_buckets_fill_in_order_never_cut_a_tensor_and_a_large_one_goes_alone() -> None:
    tensors = {"a": Sized(30), "b": Sized(50), "c": Sized(30), "big": Sized(500), "d": Sized(10)}
    parts = buckets.split(tensors, 100)
    assert [list(p) for p in parts] == [["a", "b"], ["c"], ["big"], ["d"]]
    assert [n for p in parts for n in p] == list(tensors)  # every tensor once, in order


@pytest.mark.unit
def test_split_modules_names_packed_modules_whose_parts_went_apart() -> None:
    layer = "model.layers.3"
    one = {f"{layer}.self_attn.q_proj.weight": 0, f"{layer}.self_attn.k_proj.weight": 0,
           f"{layer}.mlp.gate_proj.weight": 0}
    two = {f"{layer}.self_attn.v_proj.weight": 0, f"{layer}.mlp.up_proj.weight": 0, f"{layer}.mlp.down_proj.weight": 0}
    assert buckets.split_modules([one, two]) == [f"{layer}.self_attn.qkv_proj", f"{layer}.mlp.gate_up_proj"]
    assert buckets.split_modules([{**one, **two}]) == []
    assert buckets.packed_name("model.layers.0.self_attn.o_proj.weight") is None


@pytest.mark.unit
def test_bucket_mb_is_checked_and_left_out_of_older_digests() -> None:
    with pytest.raises(ConfigError, match="--loop bucket_mb"):
        merged(LoopSpec(), parse(["bucket_mb=0"]))
    with pytest.raises(ConfigError, match="--loop bucket_mb"):
        merged(LoopSpec(), parse(["bucket_mb=nan"]))
    spec = merged(LoopSpec(), parse(["bucket_mb=0.5"]))
    assert spec.bucket_bytes == 500_000 and not spec.default and "0.5 MB" in spec.describe()
    cfg = load("tiny-qwen3")

    def with_loop(loop: LoopSpec) -> ModelConfig:
        return cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"loop": loop})})

    reset = with_loop(LoopSpec(reset_prefix_cache=True))
    before = reset.model_dump(mode="json", exclude={"route_replay": True, "adapter": {"target_parameters"},
                                                    "sampler": {"sampling": True}})
    before["sampler"]["loop"].pop("bucket_mb")  # a loop receipt made before the key: its digest holds
    assert reset.digest() == sha256_json(before)
    assert len({cfg.digest(), reset.digest(), with_loop(spec).digest()}) == 3


@pytest.mark.unit
def test_buckets_other_than_the_merged_weights_in_memory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--sync memory"):
        execute(RunOptions(trainer="fake", sampler="fake", loop=["bucket_mb=1"], out=tmp_path / "r.json"))
    with pytest.raises(ConfigError, match="at once"):
        execute(RunOptions(trainer="fake", sampler="fake", sync="memory", inject="bucket-lost", out=tmp_path / "r"))
    assert not list(tmp_path.iterdir())


@pytest.mark.unit
def test_fake_backends_pass_in_buckets_and_a_lost_bucket_is_caught(tmp_path: Path) -> None:
    # The fake trainer's merged 'weights' are one number per target kind, 8 bytes each: one per bucket here.
    result = selftest(RunOptions(trainer="fake", sampler="fake", sync="memory", loop=["bucket_mb=0.000008"]),
                      tmp_path, faults=["bucket-lost"])
    clean, lost = result.rows
    assert clean.caught and lost.fault == "bucket-lost" and lost.caught, result.rows
    receipt = verify(Path(clean.receipt)).receipt
    synced = next(a for a in receipt.adapters if a.version == 1)
    assert synced.buckets is not None and len(synced.buckets) > 2 and set(synced.buckets) == {8}
    row = next(r for r in receipt.lifecycle or [] if r.condition == ROW)
    assert row.status == "covered" and "8e-06 MB" in row.detail


@pytest.mark.unit
def test_the_lifecycle_row_says_at_once_and_only_where_recorded() -> None:
    at_once = lifecycle.derive("vllm", {"sync_buckets": "at once"}, [])
    assert next(r for r in at_once if r.condition == ROW).status == "not covered"
    assert all(r.condition != ROW for r in lifecycle.derive("vllm", {}, []))  # receipts made before the row


@pytest.mark.cpu_e2e
def test_vllm_cpu_takes_whole_modules_per_bucket_and_misses_a_lost_one(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    # tiny-qwen3's merged weights, in the trainer's order: 0.4 MB buckets (5) keep every packed module whole.
    result = selftest(RunOptions(sync="memory", loop=["bucket_mb=0.4"], per_target=False), tmp_path,
                      faults=["bucket-lost"])
    clean, lost = result.rows
    receipt = verify(Path(clean.receipt)).receipt
    synced = next(a for a in receipt.adapters if a.version == 1)
    assert synced.buckets is not None and len(synced.buckets) > 2 and synced.split_modules == []
    assert clean.caught and receipt.verdict == Verdict.PASS, clean
    assert lost.caught, lost
    # X: the merged weights reloaded at once score as the bucketed sync's, bit for bit; not where a bucket was lost.
    x = {r.fault: next(c for c in verify(Path(r.receipt)).receipt.checks if c.id == "X.sync.identical")
         for r in result.rows}
    assert x["none"].status.value == "pass" and x["none"].elements, x["none"]
    assert x["bucket-lost"].status.value == "fail", x["bucket-lost"]


@pytest.mark.cpu_e2e
def test_vllm_cpu_rebuilds_a_packed_module_split_across_buckets_wrong(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    # 0.1 MB buckets split every q/k/v and gate/up of tiny-qwen3: vLLM 0.32's in-place reload rebuilds each such
    # module from the part one call carried, the rest what its memory held (measured: A fails at zero, or a phase's
    # scores are NaN, which ends the run in an error that says so). The run never passes.
    receipt = execute(RunOptions(sync="memory", loop=["bucket_mb=0.1"], per_target=False,
                                 out=tmp_path / "r.json")).receipt
    assert receipt.verdict != Verdict.PASS
    split = receipt.adapters[0].split_modules
    assert split and "model.layers.0.self_attn.qkv_proj" in split
    assert any("split 4 packed module(s)" in line for line in findings.of_receipt(receipt))
    a_failed = any(c.id.startswith("A.parity") and c.status.value == "fail" for c in receipt.checks)
    assert a_failed or "non-finite score nan" in (receipt.error or ""), (receipt.verdict, receipt.error)


@pytest.mark.unit
@pytest.mark.parametrize(("mode", "fault"), [("memory", "stale-tensors"), ("merged", "stale-path")])
def test_x_reloads_the_merged_weights_at_once_and_parts_from_a_stale_sync(mode: str, fault: str,
                                                                          tmp_path: Path) -> None:
    result = selftest(RunOptions(trainer="fake", sampler="fake", sync=mode), tmp_path, faults=[fault])
    clean, stale = (verify(Path(r.receipt)).receipt for r in result.rows)

    def x(receipt: Receipt) -> Check:
        return next(c for c in receipt.checks if c.id == "X.sync.identical")

    assert x(clean).status.value == "pass" and x(clean).observed == 0 and x(clean).elements
    assert x(stale).status.value == "fail", x(stale)
    assert [p.name for p in clean.phases].index("fresh") > [p.name for p in clean.phases].index("updated")


@pytest.mark.unit
def test_x_catches_a_lost_bucket_on_fakes(tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler="fake", sync="memory", loop=["bucket_mb=0.000008"],
                                 inject="bucket-lost", out=tmp_path / "r.json")).receipt
    x = next(c for c in receipt.checks if c.id == "X.sync.identical")
    assert x.status.value == "fail" and x.observed is not None and x.observed > 0


@pytest.mark.unit
def test_the_split_modules_finding_only_where_the_run_failed() -> None:
    split = [AdapterVersion(version=1, name="merged-v1", adapter_id=0, mode="memory", seconds=0.1, buckets=[4, 4],
                            split_modules=["model.layers.0.mlp.gate_up_proj"])]
    assert "model.layers.0.mlp.gate_up_proj" in (findings.bucket_line(split, {"A.parity.mean"}, None) or "")
    assert findings.bucket_line(split, set(), "phase zero: non-finite score nan") is not None
    assert findings.bucket_line(split, set(), None) is None  # a passing run needs no excuse
    whole = [split[0].model_copy(update={"split_modules": []})]
    assert findings.bucket_line(whole, {"C.parity.mean"}, None) is None
