"""The TensorRT version layer, decided for every supported version without TensorRT."""

from __future__ import annotations

import pytest

from edged.backends.tensorrt.versions import (
    BuildOptions,
    ModelTraits,
    buildable_precisions,
    check_dla,
    dla_cores_error,
    dla_supported,
    parse_version,
    plan_build,
    unsupported_reason,
    uses_device_memory_v2,
)
from edged.errors import BuildError

TRT_8_5 = (8, 5, 2)  # JetPack 5.1
TRT_8_6 = (8, 6, 2)  # JetPack 6.0
TRT_10_3 = (10, 3, 0)  # JetPack 6.1/6.2
TRT_10_13 = (10, 13, 3)  # JetPack 7
TRT_11 = (11, 4, 0)

QDQ = ModelTraits(qdq=True, fp16=False)
FP32_MODEL = ModelTraits(qdq=False, fp16=False)
FP16_MODEL = ModelTraits(qdq=False, fp16=True)
DEFAULT = BuildOptions()


def test_parse_version_takes_the_first_three_numbers() -> None:
    assert parse_version("10.3.0.30") == (10, 3, 0)
    assert parse_version("8.6.2") == (8, 6, 2)
    assert parse_version("11.0") == (11, 0, 0)
    with pytest.raises(ValueError):
        parse_version("unknown")


def test_versions_before_8_5_are_refused_with_the_reason() -> None:
    assert "8.5" in unsupported_reason((8, 4, 3))
    for ok in (TRT_8_5, TRT_8_6, TRT_10_3, TRT_11):
        assert unsupported_reason(ok) == ""
    with pytest.raises(BuildError, match=r"older than 8\.5"):
        plan_build((8, 2, 1), "fp32", DEFAULT, FP32_MODEL)


def test_device_memory_v2_from_10_1() -> None:
    assert not uses_device_memory_v2(TRT_8_6)
    assert not uses_device_memory_v2((10, 0, 1))
    assert uses_device_memory_v2(TRT_10_3)
    assert uses_device_memory_v2(TRT_11)


@pytest.mark.parametrize("version", [TRT_8_5, TRT_8_6])
def test_int8_on_8x_is_explicit_batch_with_int8_and_fp16_flags(version: tuple[int, int, int]) -> None:
    plan = plan_build(version, "int8", DEFAULT, QDQ)
    assert plan.network_flags == ("EXPLICIT_BATCH",)
    assert not plan.strongly_typed
    assert plan.builder_flags == ("INT8", "FP16")
    assert not plan.calibrator


@pytest.mark.parametrize("version", [TRT_10_3, TRT_10_13])
def test_int8_on_10_is_a_strongly_typed_network_without_precision_flags(
    version: tuple[int, int, int],
) -> None:
    plan = plan_build(version, "int8", DEFAULT, QDQ)
    assert plan.network_flags == ("STRONGLY_TYPED",)
    assert plan.strongly_typed
    assert plan.builder_flags == ()


def test_int8_on_11_is_strongly_typed_without_the_deprecated_flag() -> None:
    plan = plan_build(TRT_11, "int8", DEFAULT, QDQ)
    assert plan.strongly_typed
    assert plan.network_flags == ()  # 11 ignores STRONGLY_TYPED: every network is typed
    assert plan.builder_flags == ()


@pytest.mark.parametrize("version", [TRT_8_5, TRT_10_3, TRT_11])
def test_int8_without_qdq_nodes_is_refused(version: tuple[int, int, int]) -> None:
    with pytest.raises(BuildError, match="Q/DQ model"):
        plan_build(version, "int8", DEFAULT, FP32_MODEL, "m.onnx")


def test_fp16_uses_the_builder_flag_up_to_10_and_a_typed_model_from_10() -> None:
    assert plan_build(TRT_8_6, "fp16", DEFAULT, FP32_MODEL).builder_flags == ("FP16",)
    weak = plan_build(TRT_10_3, "fp16", DEFAULT, FP32_MODEL)
    assert (weak.strongly_typed, weak.builder_flags, weak.network_flags) == (False, ("FP16",), ())
    typed = plan_build(TRT_10_3, "fp16", DEFAULT, FP16_MODEL)
    assert (typed.strongly_typed, typed.builder_flags) == (True, ())
    on_11 = plan_build(TRT_11, "fp16", DEFAULT, FP16_MODEL)
    assert (on_11.strongly_typed, on_11.builder_flags) == (True, ())


def test_fp16_on_11_from_an_fp32_model_says_how_to_convert_it() -> None:
    with pytest.raises(BuildError, match="AutoCast"):
        plan_build(TRT_11, "fp16", DEFAULT, FP32_MODEL)


def test_fp32_is_strongly_typed_from_10() -> None:
    assert not plan_build(TRT_8_5, "fp32", DEFAULT, FP32_MODEL).strongly_typed
    assert plan_build(TRT_10_3, "fp32", DEFAULT, FP32_MODEL).strongly_typed
    assert plan_build(TRT_11, "fp32", DEFAULT, FP32_MODEL).builder_flags == ()


LEGACY = BuildOptions(legacy_calibrator=True)


@pytest.mark.parametrize("version", [TRT_8_5, TRT_8_6, TRT_10_3, TRT_10_13])
def test_legacy_calibrator_up_to_10_is_weakly_typed_int8(version: tuple[int, int, int]) -> None:
    plan = plan_build(version, "int8", LEGACY, FP32_MODEL, samples=True)
    assert plan.calibrator
    assert not plan.strongly_typed
    assert "INT8" in plan.builder_flags
    assert "STRONGLY_TYPED" not in plan.network_flags
    assert any("deprecated" in n for n in plan.notes) == (version[0] == 10)


def test_legacy_calibrator_is_refused_on_11_with_a_clear_message() -> None:
    with pytest.raises(BuildError, match=r"removed in TensorRT 11.*legacy_calibrator = false"):
        plan_build(TRT_11, "int8", LEGACY, FP32_MODEL, samples=True)


def test_legacy_calibrator_needs_the_fp32_model_and_samples() -> None:
    with pytest.raises(BuildError, match="FP32 model"):
        plan_build(TRT_8_6, "int8", LEGACY, QDQ, samples=True)
    with pytest.raises(BuildError, match=r"calibration samples \(\[models.NAME.calibration\]\)"):
        plan_build(TRT_8_6, "int8", LEGACY, FP32_MODEL)


def test_legacy_calibrator_is_ignored_with_a_note_for_other_precisions() -> None:
    plan = plan_build(TRT_10_3, "fp16", LEGACY, FP32_MODEL)
    assert not plan.calibrator
    assert any("int8 only" in n for n in plan.notes)


def test_dla_adds_gpu_fallback_and_warns_about_fp32() -> None:
    dla = BuildOptions(dla_core=1)
    plan = plan_build(TRT_8_6, "fp16", dla, FP32_MODEL)
    assert plan.dla_core == 1
    assert plan.builder_flags == ("FP16", "GPU_FALLBACK")
    fp32 = plan_build(TRT_10_3, "fp32", dla, FP32_MODEL)
    assert "GPU_FALLBACK" in fp32.builder_flags
    assert any("falls back to the GPU" in n for n in fp32.notes)
    assert plan_build(TRT_10_3, "fp32", DEFAULT, FP32_MODEL).dla_core == -1


def test_optimisation_level_is_skipped_on_8_5() -> None:
    opts = BuildOptions(builder_optimization_level=5)
    assert plan_build(TRT_8_6, "fp32", opts, FP32_MODEL).optimization_level == 5
    plan = plan_build(TRT_8_5, "fp32", opts, FP32_MODEL)
    assert plan.optimization_level is None
    assert any("8.6" in n for n in plan.notes)


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(BuildError, match="bf16"):
        plan_build(TRT_10_3, "bf16", DEFAULT, FP32_MODEL)


def test_newer_major_builds_as_11_with_a_note() -> None:
    plan = plan_build((12, 0, 0), "int8", DEFAULT, QDQ)
    assert plan.strongly_typed and plan.builder_flags == ()
    assert any("newer" in n for n in plan.notes)


def test_build_options_from_the_config_table() -> None:
    opts = BuildOptions.from_mapping(
        {
            "workspace": "512MiB",
            "dla_core": 0,
            "legacy_calibrator": False,
            "builder_optimization_level": 4,
            "unrelated": 1,
        }
    )
    assert opts.workspace == 512 * 1024**2
    assert (opts.dla_core, opts.builder_optimization_level) == (0, 4)
    assert BuildOptions.from_mapping({"workspace": 1 << 20}).workspace == 1 << 20


@pytest.mark.parametrize(
    "bad",
    [
        {"workspace": "lots"},
        {"workspace": True},
        {"dla_core": "0"},
        {"dla_core": -2},
        {"builder_optimization_level": 9},
        {"legacy_calibrator": 1},
        {"instances": "2"},
        {"keep_fp32": "Sigmoid"},
        {"keep_fp32": ["Sigmoid", 3]},
    ],
)
def test_build_options_reject_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(BuildError, match="tensorrt option"):
        BuildOptions.from_mapping(bad)


@pytest.mark.parametrize("bad", [{"instances": 0}, {"device": -1}, {"float_parts": "bf16"}])
def test_build_options_reject_bad_ranges(bad: dict[str, object]) -> None:
    with pytest.raises(BuildError, match="tensorrt option"):
        BuildOptions.from_mapping(bad)


def test_keep_fp32_is_a_list_of_names() -> None:
    assert BuildOptions.from_mapping({"keep_fp32": ["Sigmoid", "head/conv"]}).keep_fp32 == ("Sigmoid", "head/conv")


# --- profiles for several instances of a dynamic engine -----------------------------------------

FOUR = BuildOptions(instances=4)


def test_8_5_builds_one_profile_per_instance() -> None:
    plan = plan_build(TRT_8_5, "fp32", FOUR, FP32_MODEL)
    assert plan.profile_copies == 4 and plan.preview_features == ()


def test_8_6_builds_one_shared_profile_with_the_preview_feature() -> None:
    plan = plan_build(TRT_8_6, "int8", FOUR, QDQ)
    assert plan.profile_copies == 1 and plan.preview_features == ("PROFILE_SHARING_0806",)


@pytest.mark.parametrize("version", [TRT_10_3, TRT_10_13, TRT_11])
def test_10_and_later_share_profile_0_as_built(version: tuple[int, int, int]) -> None:
    plan = plan_build(version, "fp32", FOUR, FP32_MODEL)
    assert plan.profile_copies == 1 and plan.preview_features == ()


# --- DLA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [(11, 0, 0), (11, 3, 2)])
def test_dla_on_a_tensorrt_without_dla_says_so(version: tuple[int, int, int]) -> None:
    with pytest.raises(BuildError, match=r"no DLA support.*dla_core = -1"):
        plan_build(version, "int8", BuildOptions(dla_core=0), QDQ)
    with pytest.raises(BuildError, match="no DLA support"):
        check_dla(version, 0, {})


def test_dla_needs_static_profiles_and_says_what_to_change() -> None:
    assert plan_build((11, 4, 1), "int8", BuildOptions(dla_core=0), QDQ).dla_core == 0
    static = {"x": ((1, 3, 64, 64), (1, 3, 64, 64), (1, 3, 64, 64))}
    check_dla(TRT_10_3, 0, static)
    check_dla(TRT_10_3, -1, {"x": ((1, 3), (2, 3), (4, 3))})  # GPU: any profile
    with pytest.raises(BuildError, match=r"'x'.*min = opt = max.*dla_core = -1"):
        check_dla(TRT_10_3, 0, {"x": ((1, 3), (2, 3), (4, 3))})


# --- strongly typed int8: float parts in FP16 ----------------------------------------------------


def test_float_parts_go_fp16_only_on_strongly_typed_int8() -> None:
    assert plan_build(TRT_10_3, "int8", DEFAULT, QDQ).fp16_float_parts
    assert plan_build(TRT_11, "int8", DEFAULT, QDQ).fp16_float_parts
    assert not plan_build(TRT_10_3, "int8", BuildOptions(float_parts="fp32"), QDQ).fp16_float_parts
    assert not plan_build(TRT_8_6, "int8", DEFAULT, QDQ).fp16_float_parts  # the FP16 flag does it
    assert not plan_build(TRT_10_3, "fp32", DEFAULT, FP32_MODEL).fp16_float_parts


def test_a_dla_model_with_a_dynamic_profile_is_refused_at_config_time() -> None:
    from edged.config import from_mapping
    from edged.errors import ConfigError

    model = {"path": "m.onnx", "profiles": {"x": {"min": [1, 3], "opt": [2, 3], "max": [4, 3]}}}
    from_mapping({"models": {"m": model}})  # on the GPU: fine
    with pytest.raises(ConfigError, match=r"models.m.profiles.x: DLA .* set min = opt = max .* or dla_core = -1"):
        from_mapping({"models": {"m": dict(model, tensorrt={"dla_core": 0})}})
    static = {"x": {"min": [2, 3], "opt": [2, 3], "max": [2, 3]}}
    assert from_mapping({"models": {"m": dict(model, profiles=static, tensorrt={"dla_core": 0})}}).models["m"]


# --- what can be built, and where DLA exists ------------------------------------------------------


@pytest.mark.parametrize(
    "version, traits, opts, buildable",
    [
        (TRT_11, FP32_MODEL, DEFAULT, ("int8", "fp32")),  # no FP16 flag: fp16 needs an FP16 model
        (TRT_11, FP16_MODEL, DEFAULT, ("int8", "fp16", "fp32")),
        (TRT_11, FP32_MODEL, LEGACY, ("fp32",)),  # no implicit calibrator either
        ((11, 0, 0), FP32_MODEL, BuildOptions(dla_core=0), ()),  # no DLA: nothing builds
        (TRT_10_13, FP32_MODEL, DEFAULT, ("int8", "fp16", "fp32")),
        (TRT_10_3, FP32_MODEL, LEGACY, ("int8", "fp16", "fp32")),
        (TRT_8_5, FP32_MODEL, DEFAULT, ("int8", "fp16", "fp32")),
    ],
)
def test_buildable_precisions_follow_the_plan(
    version: tuple[int, int, int], traits: ModelTraits, opts: BuildOptions, buildable: tuple[str, ...]
) -> None:
    assert buildable_precisions(version, traits, opts) == buildable


@pytest.mark.parametrize(
    "version, dla",
    [
        (TRT_8_5, True),
        (TRT_8_6, True),
        (TRT_10_3, True),
        ((10, 7, 0), True),
        ((10, 8, 0), False),  # 10.7 was the last 10.x with DLA
        (TRT_10_13, False),  # JetPack 7: Thor, which has no DLA
        ((11, 0, 0), False),
        ((11, 4, 0), False),  # DLA on Windows on ARM only
        ((11, 4, 1), True),  # back on Jetson AGX Orin with JetPack 7.2.2+
    ],
)
def test_dla_exists_up_to_10_7_and_again_from_11_4_1(version: tuple[int, int, int], dla: bool) -> None:
    assert dla_supported(version) is dla
    if not dla:
        with pytest.raises(BuildError, match=r"no DLA support .*Jetson Thor has no DLA"):
            plan_build(version, "fp16", BuildOptions(dla_core=0), FP32_MODEL)


def test_the_dla_core_error_names_the_board_not_orins_cores() -> None:
    thor = "NVIDIA Jetson AGX Thor Developer Kit (nvidia,p3834-0008)"
    text = dla_cores_error(0, 0, thor)
    assert text == f"tensorrt.dla_core = 0, but {thor} has no DLA cores: set dla_core = -1 to run on the GPU"
    assert "Orin" not in text
    assert "only 2 DLA core(s) (0..1)" in dla_cores_error(2, 2, "NVIDIA Jetson AGX Orin (nvidia,p3701-0005)")
    assert dla_cores_error(0, 0, "").startswith("tensorrt.dla_core = 0, but this GPU has no DLA cores")


def test_every_plan_names_the_version_it_was_made_for() -> None:
    for version in (TRT_8_5, TRT_8_6, TRT_10_3, TRT_10_13, TRT_11):
        assert plan_build(version, "fp32", DEFAULT, FP32_MODEL).version == version
