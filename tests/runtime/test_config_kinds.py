"""GenerationConfig's kinds: the strings users pass become enum members once, in __post_init__."""
from __future__ import annotations

import dataclasses

import pytest

from specdec.runtime.adaptive_gamma import GAMMA_POLICY_KINDS, GammaPolicyName
from specdec.runtime.config import DRAFTER_KINDS, Coupling, DrafterName, GenerationConfig, OptionError


def test_the_strings_users_pass_become_members():
    config = GenerationConfig(drafter="prompt_lookup", gamma_policy="adaptive", coupling="gumbel")
    assert type(config.drafter) is DrafterName and config.drafter is DrafterName.PROMPT_LOOKUP
    assert config.gamma_policy is GammaPolicyName.ADAPTIVE and config.coupling is Coupling.GUMBEL
    assert config.drafter_kind is DRAFTER_KINDS[DrafterName.PROMPT_LOOKUP] and config.gumbel
    assert config.gamma_policy_kind is GAMMA_POLICY_KINDS[GammaPolicyName.ADAPTIVE]
    default = GenerationConfig()
    assert (default.drafter, default.gamma_policy, default.coupling) == (
        DrafterName.AUTO, GammaPolicyName.FIXED, Coupling.LEVIATHAN)
    assert dataclasses.replace(default, drafter="none").drafter is DrafterName.NONE
    assert dataclasses.asdict(config)["drafter"] == "prompt_lookup"  # a member is equal to its string


@pytest.mark.parametrize("option, value, hint", [
    ("drafter", "Auto", "choose one of auto, model, prompt_lookup, none, head"),
    ("gamma_policy", "greedy", "choose one of fixed, adaptive, heuristic"),
    ("coupling", 1, "choose one of leviathan, gumbel"),
])
def test_an_unknown_kind_is_refused_with_the_choices(option, value, hint):
    with pytest.raises(OptionError, match=f"{option} {value!r} is unknown") as info:
        GenerationConfig(**{option: value})
    assert info.value.hint == hint and info.value.option == option
