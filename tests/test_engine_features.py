"""The engine detectors on source trees shaped like the releases' (the real releases: test_compat_survey)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_kit.compat import engine_features as ef
from dspark_kit.compat import engine_table

# vLLM 0.25.0-0.26.0: every speculators DSpark checkpoint is rewritten to the bonus anchor
LOADER_FORCED = '''
@register_speculator("dspark")
def update_dspark(config_dict: dict, pre_trained_config: dict) -> None:
    pre_trained_config["architectures"] = ["Qwen3DSparkModel"]
    pre_trained_config["dspark_bonus_anchor"] = True
    aux_layer_ids = config_dict["aux_hidden_state_layer_ids"]
    for key in ("draft_vocab_size", "mask_token_id", "block_size"):
        if config_dict.get(key) is not None:
            pre_trained_config[key] = config_dict[key]
'''
# vLLM 0.27.0 and later: the key is read, missing = False
LOADER_READS = LOADER_FORCED.replace(
    'pre_trained_config["dspark_bonus_anchor"] = True',
    'sample_from_anchor = config_dict.get("sample_from_anchor", False)\n'
    '    pre_trained_config["sample_from_anchor"] = sample_from_anchor\n'
    '    pre_trained_config["dspark_bonus_anchor"] = not sample_from_anchor')
K_GUARD = '''
                if self.method == "dspark":
                    dspark_block_size = getattr(self.draft_model_config.hf_config, "dspark_block_size", None)
                    if (
                        dspark_block_size is not None
                        and self.num_speculative_tokens < dspark_block_size
                    ):
                        raise ValueError(
                            "DSpark requires num_speculative_tokens >= "
                            f"dspark_block_size ({dspark_block_size})")
'''
SPECULATIVE = '''
class SpeculativeConfig:
    method: Literal["eagle", "dflash", "dspark"] = None
'''
ADAPTIVE = '''
    enable_adaptive_verification: bool = False
    """Whether to adaptively size the draft-verification budget."""
'''


def vllm_tree(root: Path, *, model=True, loader=LOADER_READS, spec=SPECULATIVE) -> Path:
    files = {ef.VLLM_FILES["speculative"]: spec, ef.VLLM_FILES["loader"]: loader}
    if model:
        files[ef.VLLM_FILES["model"]] = "class Qwen3DSparkModel: ...\n"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_vllm_without_the_model_has_no_dspark(tmp_path):
    f = ef.vllm_features(vllm_tree(tmp_path, model=False), "0.24.0")
    assert (f.dspark, f.anchor, f.adaptive) == (False, "none", False)


def test_the_loader_decides_the_anchor_layout(tmp_path):
    assert ef.vllm_features(vllm_tree(tmp_path / "a", loader=LOADER_FORCED), "0.25.0").anchor == "forced-bonus"
    f = ef.vllm_features(vllm_tree(tmp_path / "b", loader=LOADER_READS), "0.29.0")
    assert f.anchor == "default-false"
    assert {"aux_hidden_state_layer_ids", "sample_from_anchor", "block_size", "mask_token_id"} <= set(f.config_keys)
    default_true = LOADER_READS.replace('"sample_from_anchor", False', '"sample_from_anchor", True')
    assert ef.vllm_features(vllm_tree(tmp_path / "c", loader=default_true), "9.0").anchor == "default-true"


def test_k_guard_is_found_with_its_key_and_judged_against_the_loader(tmp_path):
    f = ef.vllm_features(vllm_tree(tmp_path, spec=SPECULATIVE + K_GUARD), "0.26.0")
    assert f.k_guard == "dspark_block_size"
    assert any("not applied to speculators checkpoints" in n for n in f.notes)
    assert ef.vllm_features(vllm_tree(tmp_path / "no", spec=SPECULATIVE), "0.28.0").k_guard is None


def test_adaptive_verification_is_a_speculative_config_field(tmp_path):
    assert ef.vllm_features(vllm_tree(tmp_path, spec=SPECULATIVE + ADAPTIVE), "0.28.0").adaptive is True
    # named elsewhere (a comment, a log line) is not the field
    other = SPECULATIVE + "# enable_adaptive_verification: bool comes later\n"
    assert ef.vllm_features(vllm_tree(tmp_path / "b", spec=other), "0.27.0").adaptive is False


PRE_14596 = '''
        self.draft_window_size = (
            self.vllm_config.additional_config.get("draft_window_size") if self.vllm_config.additional_config else None
        )
        if self.draft_window_size is not None:
            future_offset = 0 if self.method == "dflash" else self.num_speculative_tokens
'''
WITH_14596 = PRE_14596.replace('self.method == "dflash"', 'self.method in ("dflash", "dspark")')
DYNAMIC = '''
class DynamicSpecConfig:
    SUPPORTED_METHODS: ClassVar[tuple[str, ...]] = ("dspark", "dflash")
'''
PATCH_48639 = '''
_orig_update_dspark = speculator_algos.SUPPORTED_SPECULATORS_TYPES["dspark"]


def _update_dspark(config_dict: dict, pre_trained_config: dict) -> None:
    _orig_update_dspark(config_dict, pre_trained_config)
    pre_trained_config["sample_from_anchor"] = config_dict.get("sample_from_anchor", False)
'''


def ascend_tree(root: Path, *, window=WITH_14596, dynamic=DYNAMIC, patch=None,
                proposer='getattr(self.draft_model_config.hf_config, "sample_from_anchor", True)') -> Path:
    files = {ef.ASCEND_FILES["dispatch"]: 'elif method == "dspark":\n    return DSparkProposer\n',
             ef.ASCEND_FILES["proposer"]: proposer, ef.ASCEND_FILES["base_proposer"]: window,
             ef.ASCEND_FILES["ascend_config"]: dynamic, ef.ASCEND_FILES["paired_vllm"]: "v0.27.1\n"}
    if patch:
        files[ef.ASCEND_FILES["loader_patch"]] = patch
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def paired(tmp_path, version, **kw) -> ef.Features:
    return ef.vllm_features(vllm_tree(tmp_path / f"vllm-{version}", **kw), version)


def test_ascend_serves_only_on_a_paired_vllm_with_dspark(tmp_path):
    root = ascend_tree(tmp_path / "a")
    assert ef.paired_vllm_version(root) == "0.27.1"
    f = ef.ascend_features(root, "0.27.1rc1", paired(tmp_path, "0.27.1"))
    assert (f.dspark, f.anchor, f.window, f.adaptive) == (True, "default-false", True, True)
    old = ef.ascend_features(root, "0.24.0rc1", paired(tmp_path, "0.24.0", model=False))
    assert old.dspark is False and any("has no method dspark" in n for n in old.notes)


def test_ascend_window_needs_pr_14596(tmp_path):
    f = ef.ascend_features(ascend_tree(tmp_path / "a", window=PRE_14596), "0.26.0rc1", paired(tmp_path, "0.26.0"))
    assert f.dspark and not f.window
    assert ef.window_support_from_source(WITH_14596) and not ef.window_support_from_source("def propose(): pass")


def test_ascend_loader_patch_and_proposer_key_decide_the_anchor(tmp_path):
    forced = paired(tmp_path, "0.26.0", loader=LOADER_FORCED)
    patched = ef.ascend_features(ascend_tree(tmp_path / "a", patch=PATCH_48639), "0.26.0rc1", forced)
    assert patched.anchor == "default-false"
    unpatched = ef.ascend_features(ascend_tree(tmp_path / "b"), "0.25.1rc1", forced)
    assert unpatched.anchor == "forced-bonus"
    # a proposer that only honours dspark_bonus_anchor follows the loader's rewrite even if the key is read
    bonus_only = ascend_tree(tmp_path / "c", proposer='not getattr(self.draft_model_config.hf_config, '
                                                      '"dspark_bonus_anchor", False)')
    assert ef.ascend_features(bonus_only, "x", paired(tmp_path, "0.27.1")).anchor == "forced-bonus"


def test_ascend_dynamic_spec_needs_dspark_among_its_methods(tmp_path):
    no = ascend_tree(tmp_path, dynamic=DYNAMIC.replace('"dspark", ', ""))
    assert ef.ascend_features(no, "x", paired(tmp_path, "0.27.1")).adaptive is False


@pytest.mark.parametrize("engine", engine_table.ENGINES)
def test_the_table_starts_at_the_surveyed_minimum(engine):
    versions = [engine_table._v(f.version) for f in engine_table.rows(engine)]
    assert versions == sorted(set(versions))
    assert versions[0] >= engine_table._v(engine_table.MINIMUM[engine])


def test_the_committed_doc_is_the_committed_table_rendered():
    found = [f for e in engine_table.ENGINES for f in engine_table.rows(e)]
    assert engine_table.DOC.read_text() == engine_table.markdown(found)
