"""The study's arms for the whole differential family (issue 24): the ``--variants`` spelling of each, its head
count at a shared Q/K width, its model config and parameter count against the standard arm."""

from __future__ import annotations

import pytest

from diffattn.experiments.study.spec import StudyError, StudySpec, parse_variant
from diffattn.model.transformer import TransformerLM

FAMILY = ["diff+nosubln", "diff_v2", "dint", "shared_diff", "shared_diff+matched", "diff+shared_qk", "distance",
          "distance+norope", "alibi"]


def test_every_arm_of_the_family_is_spelled_sized_and_configured(tmp_path):
    spec = StudySpec.from_dict(dict(data=str(tmp_path / "x.txt"), d_model=128, n_layers=2, head_dims=[32], lrs=[1e-3],
                     variants=FAMILY))
    heads = {a.name: a.n_heads for a in spec.arms()}
    assert heads == {"diff": 2, "standard": 4, "diff+nosubln": 2, "diff_v2": 4, "dint": 2, "shared_diff": 2,
                     "shared_diff+matched": 2, "diff+shared_qk": 2, "distance": 4, "distance+norope": 4, "alibi": 4}
    cfgs = {a.name: spec.arm_config(a, 65) for a in spec.arms()}
    n = {name: TransformerLM(c).num_params() for name, c in cfgs.items()}
    assert cfgs["distance"].rope == "interleaved" and cfgs["distance+norope"].rope == "none"
    assert cfgs["alibi"].rope == "none"  # ALiBi's bias is its position signal
    assert not cfgs["diff+nosubln"].options.subln and cfgs["diff+shared_qk"].shared_qk
    # parameters against the standard arm: V1-shaped arms within 0.2%, Shared DIFF fewer unless +matched
    for name in ("diff", "diff+nosubln", "dint", "distance", "alibi"):
        assert abs(n[name] / n["standard"] - 1) < 0.002, name
    assert n["shared_diff"] < 0.97 * n["standard"]
    assert abs(n["shared_diff+matched"] / n["standard"] - 1) < 0.002
    assert cfgs["shared_diff+matched"].ffn_dim > cfgs["shared_diff"].ffn_dim


@pytest.mark.parametrize("variant,message", [("alibi+norope", "takes no RoPE anyway"),
                                             ("diff_v2+nosubln", "has none"),
                                             ("alibi+qk_norm", "unknown or repeated option")])
def test_options_a_type_does_not_have_are_refused(variant, message):
    with pytest.raises(StudyError, match=message):
        parse_variant(variant)
