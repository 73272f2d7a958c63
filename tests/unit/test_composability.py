"""The composability table of docs/vocabulary.md (fsdp_exp.composability): read from preflight's own checks,
and current."""

from __future__ import annotations

from pathlib import Path

from fsdp_exp import composability

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vocabulary.md"


def test_the_vocabulary_page_with_its_composability_table_is_generated_from_the_checks():
    assert DOCS.read_text() == composability.page(), "regenerate: python -m fsdp_exp.composability > docs/vocabulary.md"


def test_a_refused_pair_shows_preflight_s_own_reason_and_an_accepted_one_composes():
    assert composability.outcome(composability.overrides_of({"sharding": "ddp", "tp": "2"})) is not None
    assert "composes with FSDP2 only" in composability.cell("sharding", "tp")
    assert composability.outcome(composability.overrides_of({"compile": "true", "ac": "full"})) is None
    assert composability.cell("compile", "ac") == "composes"


def test_tensor_parallel_compiled_inside_one_fsdp_unit_is_refused_naming_wrap_block():
    """The every-pair test's crash ('_local_tensor' in DTensor's redistribute backward: tp=2, compile=true,
    wrap=none or size, with or without AC) is refused before any rank starts; with wrap=block it runs."""
    for wrap in ("none", "size"):
        refusal = composability.outcome(composability.overrides_of({"tp": "2", "compile": "true", "wrap": wrap}))
        assert refusal is not None and "pass wrap=block" in refusal, refusal
    assert composability.outcome(composability.overrides_of({"tp": "2", "compile": "true"})) is None
