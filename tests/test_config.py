"""Tests for dilocod.config: loading configs/*.toml, `--set` overrides, strict typing and validation."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import torch

from dilocod.codecs import TopKCodec
from dilocod.config import (
    DEFAULT_RUN_ID,
    AveragingConfig,
    Config,
    ConfigError,
    NetConfig,
    RunConfig,
    describe,
    load_config,
)
from dilocod.diloco.outer import OuterConfig
from dilocod.node.autodeadlines import resolve_deadlines
from dilocod.trainer.batches import DataConfig
from dilocod.trainer.model import PRESETS, ModelConfig
from dilocod.trainer.settings import TrainerConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.toml"))


def config_error(path: str | Path | None = None, overrides: list[str] | None = None) -> str:
    """The message of the ConfigError that loading raises; checks it is a single line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------- shipped configs and defaults


def test_configs_directory_is_not_empty() -> None:
    assert {p.stem for p in CONFIG_FILES} >= {"tiny", "small", "124m", "1b"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_config_loads_and_validates(path: Path) -> None:
    config = load_config(path)
    config.validate()
    assert config.model.preset == path.stem
    assert config.model.preset in PRESETS
    assert config.run.id == DEFAULT_RUN_ID


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_config_values_land_in_their_fields(path: Path) -> None:
    config = load_config(path)
    raw = tomllib.loads(path.read_text())
    assert raw, f"{path.name} sets nothing"
    for section, values in raw.items():
        for name, value in values.items():
            got = getattr(getattr(config, section), name)
            assert got == (tuple(value) if isinstance(value, list) else value), f"{section}.{name}"


def test_no_file_gives_the_defaults() -> None:
    config = load_config(None)
    assert config == Config()
    assert config.run == RunConfig(id=DEFAULT_RUN_ID, seed=0)
    assert config.model == ModelConfig()
    assert config.data == DataConfig()
    assert config.trainer == TrainerConfig()
    assert config.outer == OuterConfig()
    assert config.averaging == AveragingConfig()
    assert config.net == NetConfig()


def test_defaults_have_documented_values() -> None:
    config = Config()
    assert config.model.preset == "tiny"
    assert config.trainer.inner_steps == 20
    # the plain average (tiny's measured best); the bigger presets' files set the published Nesterov step
    assert (config.outer.lr, config.outer.momentum, config.outer.nesterov) == (0.0, 0.0, True)
    assert (config.outer.optimizer, config.outer.step_lr) == ("sgd", 1.0)  # lr 0: sgd's own, 1.0
    for name in ("small", "124m", "1b"):
        big = load_config(Path(__file__).resolve().parent.parent / "configs" / f"{name}.toml")
        assert (big.outer.lr, big.outer.momentum, big.outer.nesterov) == (0.7, 0.9, True)
    # deadlines default to auto (0): the rule's matchmaking deadline is always above the leader's window
    assert (config.averaging.matchmaking_timeout, config.averaging.allreduce_timeout) == (0.0, 0.0)
    resolved, _ = resolve_deadlines(config)
    assert config.averaging.min_matchmaking_time < resolved.averaging.matchmaking_timeout
    assert config.net.port == 0 and config.net.announce == ()


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write_toml(tmp_path, "")) == Config()


def test_describe_is_plain_data_per_section() -> None:
    described = describe(load_config(None, ["trainer.inner_steps=7"]))
    assert set(described) == {f.name for f in dataclasses.fields(Config)}
    assert described["trainer"]["inner_steps"] == 7
    assert described["outer"] == dataclasses.asdict(OuterConfig())


# ---------------------------------------------------------------- --set overrides


def test_set_int() -> None:
    config = load_config(None, ["trainer.inner_steps=7"])
    assert config.trainer.inner_steps == 7
    assert type(config.trainer.inner_steps) is int


def test_set_float() -> None:
    assert load_config(None, ["outer.lr=0.25"]).outer.lr == 0.25


def test_set_int_literal_for_float_field_becomes_float() -> None:
    lr = load_config(None, ["outer.lr=1"]).outer.lr
    assert lr == 1.0 and type(lr) is float


def test_set_bool() -> None:
    assert load_config(None, ["outer.nesterov=false"]).outer.nesterov is False
    assert load_config(None, ["outer.nesterov=true"]).outer.nesterov is True


def test_set_bare_string() -> None:
    assert load_config(None, ["trainer.device=cpu"]).trainer.device == "cpu"
    assert load_config(None, ["data.source=/some/dir/corpus.jsonl"]).data.source == "/some/dir/corpus.jsonl"


def test_set_bare_string_with_space_is_kept_whole() -> None:
    assert load_config(None, ["data.source=my corpus.txt"]).data.source == "my corpus.txt"


def test_set_quoted_string() -> None:
    assert load_config(None, ['run.id="run-2"']).run.id == "run-2"
    assert load_config(None, ['run.id="2024"']).run.id == "2024"


def test_set_list_of_strings_becomes_tuple() -> None:
    config = load_config(None, ['net.announce=["/ip4/1.2.3.4/tcp/5", "/dns/example.org/tcp/6"]'])
    assert config.net.announce == ("/ip4/1.2.3.4/tcp/5", "/dns/example.org/tcp/6")


def test_set_empty_list() -> None:
    assert load_config(None, ["net.announce=[]"]).net.announce == ()


def test_set_tolerates_whitespace_around_key_and_value() -> None:
    assert load_config(None, [" trainer.inner_steps = 9 "]).trainer.inner_steps == 9


def test_set_overrides_the_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[trainer]\ninner_steps = 5\nbatch_size = 3\n")
    config = load_config(path, ["trainer.inner_steps=11"])
    assert config.trainer.inner_steps == 11
    assert config.trainer.batch_size == 3


def test_later_set_wins() -> None:
    assert load_config(None, ["trainer.inner_steps=3", "trainer.inner_steps=4"]).trainer.inner_steps == 4


def test_set_only_touches_its_own_field() -> None:
    config = load_config(None, ["averaging.group_size=4"])
    assert config.averaging == dataclasses.replace(AveragingConfig(), group_size=4)
    assert config.trainer == TrainerConfig()


# ---------------------------------------------------------------- unknown keys and wrong types


def test_unknown_section_in_set() -> None:
    assert "unknown config key 'foo'" in config_error(overrides=["foo.bar=1"])


def test_unknown_section_in_file(tmp_path: Path) -> None:
    assert "'bogus'" in config_error(write_toml(tmp_path, "[bogus]\nx = 1\n"))


def test_unknown_key_in_set() -> None:
    assert "unknown config key 'trainer.foo'" in config_error(overrides=["trainer.foo=1"])


def test_unknown_key_in_file(tmp_path: Path) -> None:
    assert "'trainer.foo'" in config_error(write_toml(tmp_path, "[trainer]\nfoo = 1\n"))


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    message = config_error(write_toml(tmp_path, "trainer = 5\n"))
    assert "'trainer'" in message and "table" in message


def test_set_into_a_section_that_is_not_a_table(tmp_path: Path) -> None:
    message = config_error(write_toml(tmp_path, "trainer = 5\n"), ["trainer.lr=1.0"])
    assert "'trainer'" in message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.inner_steps=abc", "trainer.inner_steps"),  # a string for an int
        ("trainer.inner_steps=true", "trainer.inner_steps"),  # a bool is not an int
        ("trainer.inner_steps=2.0", "trainer.inner_steps"),  # a float is not an int
        ("trainer.inner_steps=1.5", "trainer.inner_steps"),
        ("outer.lr=true", "outer.lr"),  # a bool is not a number
        ("outer.lr=fast", "outer.lr"),
        ("outer.nesterov=1", "outer.nesterov"),  # an int is not a bool
        ("outer.nesterov=yes", "outer.nesterov"),
        ("net.announce=/ip4/1.2.3.4/tcp/5", "net.announce"),  # a string is not a list
        ("net.announce=[1, 2]", "net.announce"),
        ("trainer.inner_steps=[1]", "trainer.inner_steps"),
    ],
)
def test_wrong_type_in_set_names_the_key(override: str, key: str) -> None:
    message = config_error(overrides=[override])
    assert f"'{key}'" in message


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[trainer]\ninner_steps = "20"\n', "trainer.inner_steps"),
        ("[trainer]\ninner_steps = 1.5\n", "trainer.inner_steps"),
        ("[trainer]\ninner_steps = false\n", "trainer.inner_steps"),
        ("[averaging]\nmatchmaking_timeout = true\n", "averaging.matchmaking_timeout"),
        ("[net]\nport = 80.0\n", "net.port"),
        ("[run]\nid = 7\n", "run.id"),
    ],
)
def test_wrong_type_in_file_names_the_key(tmp_path: Path, toml: str, key: str) -> None:
    assert f"'{key}'" in config_error(write_toml(tmp_path, toml))


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.inner_steps=0", "trainer.inner_steps"),
        ("trainer.lr=0", "trainer.lr"),
        ("outer.momentum=1.0", "outer.momentum"),
        ("outer.momentum=-0.1", "outer.momentum"),
        ("outer.lr=-0.5", "outer.lr"),
        ("outer.lr=nan", "outer.lr"),
        ("averaging.min_group_size=1", "averaging.min_group_size"),
        ("averaging.request_timeout=0", "averaging.request_timeout"),
        ("net.port=70000", "net.port"),
        ("net.reachability=sometimes", "net.reachability"),
        ("averaging.compression=int3", "averaging.compression"),
        ("trainer.optimizer=sgd", "trainer.optimizer"),
        ("trainer.muon_lr_ratio=0", "trainer.muon_lr_ratio"),
        ("averaging.compression=INT8", "averaging.compression"),
        ("data.eval_fraction=1.0", "data.eval_fraction"),
        ("model.preset=huge", "model.preset"),
        ("run.id=a.b", "run.id"),
        ("run.id=a b", "run.id"),
        ('run.id=""', "run.id"),
        (f'run.id="{"x" * 65}"', "run.id"),
    ],
)
def test_bad_value_is_rejected_naming_the_key(override: str, key: str) -> None:
    message = config_error(overrides=[override])
    assert key in message


@pytest.mark.parametrize("timeout", ["4.0", "3.5", "1"])  # equal to, then below min_matchmaking_time
def test_matchmaking_timeout_not_above_min_matchmaking_time_is_rejected(timeout: str) -> None:
    overrides = ["averaging.min_matchmaking_time=4.0", f"averaging.matchmaking_timeout={timeout}"]
    message = config_error(overrides=overrides)
    assert "averaging.matchmaking_timeout" in message and "averaging.min_matchmaking_time" in message


def test_matchmaking_timeout_just_above_min_matchmaking_time_passes() -> None:
    config = load_config(None, ["averaging.min_matchmaking_time=4.0", "averaging.matchmaking_timeout=4.5"])
    assert config.averaging.matchmaking_timeout == 4.5


def test_model_preset_error_lists_the_presets() -> None:
    message = config_error(overrides=["model.preset=huge"])
    assert "huge" in message
    assert all(name in message for name in PRESETS)


@pytest.mark.parametrize("run_id", ["a", "run-1_B", "x" * 64])
def test_good_run_ids_pass(run_id: str) -> None:
    assert load_config(None, [f'run.id="{run_id}"']).run.id == run_id


def test_validation_errors_in_a_file_are_config_errors(tmp_path: Path) -> None:
    assert "outer.momentum" in config_error(write_toml(tmp_path, "[outer]\nmomentum = 1.0\n"))


# ---------------------------------------------------------------- malformed --set and files


@pytest.mark.parametrize(
    "override",
    [
        "trainer.inner_steps",  # no '='
        "inner_steps=3",  # no section
        "=3",
        ".inner_steps=3",
        "trainer.=3",
        "trainer.inner_steps.x=3",  # too deep
    ],
)
def test_malformed_set_is_rejected(override: str) -> None:
    message = config_error(overrides=[override])
    assert override in message and "section.key=value" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    message = config_error(path)
    assert "not found" in message and str(path) in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    assert str(tmp_path) in config_error(tmp_path)


@pytest.mark.parametrize(
    "text", ["[trainer\n", "[trainer]\ninner_steps = \n", "x = = 1\n", "[a]\nb = 1\n[a]\n"]
)
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    path = write_toml(tmp_path, text)
    message = config_error(path)
    assert "not valid TOML" in message and str(path) in message


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- immutability


def test_config_is_frozen() -> None:
    config = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.trainer = TrainerConfig()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("section", "name", "value"),
    [
        ("run", "id", "other"),
        ("model", "preset", "small"),
        ("data", "source", "x"),
        ("trainer", "inner_steps", 5),
        ("outer", "lr", 0.1),
        ("averaging", "group_size", 2),
        ("net", "port", 1),
    ],
)
def test_every_section_is_frozen(section: str, name: str, value: object) -> None:
    part = getattr(load_config(None), section)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(part, name, value)


# ---------------------------------------------------------------- known gaps (see the report)


def test_infinite_outer_lr_is_rejected() -> None:
    assert "outer.lr" in config_error(overrides=["outer.lr=inf"])


def test_group_size_below_min_group_size_is_rejected() -> None:
    assert "averaging.group_size" in config_error(overrides=["averaging.group_size=1"])


@pytest.mark.parametrize(
    ("item", "section", "key", "expected"),
    [
        ("run.id=2024", "run", "id", "2024"),  # a string key takes the text as typed
        ("adversary.mode=nan", "adversary", "mode", "nan"),
        ("trainer.lr=1e-3", "trainer", "lr", 1e-3),  # a number key still reads the number
    ],
)
def test_bare_set_value_is_read_for_the_key_type(item: str, section: str, key: str, expected: object) -> None:
    config = load_config(None, [item])
    assert getattr(getattr(config, section), key) == expected


def test_compression_names_and_their_wire_codec() -> None:
    assert Config().averaging.compression == "int4"  # the default since the convergence study
    assert load_config(None, ["averaging.compression=none"]).averaging.wire_codec() is None
    for name in ("fp16", "int8", "int4", "int2"):
        codec = load_config(None, [f"averaging.compression={name}"]).averaging.wire_codec()
        assert codec is not None and codec.name == name
    message = config_error(overrides=["averaging.compression=int3"])
    assert message == "averaging.compression must be one of none, fp16, int8, int4, int2, topk, got 'int3'"


def test_topk_keys_make_its_codec_and_its_decaying_error_feedback() -> None:
    avg = load_config(None, ["averaging.compression=topk"]).averaging
    codec = avg.wire_codec()
    assert isinstance(codec, TopKCodec) and (codec.chunk, codec.k, codec.value_bits) == (4096, 64, 2)
    feedback = avg.error_feedback([(3, 2)])
    assert feedback is not None and feedback.decay == 0.95  # SparseLoCo's, when ef_decay is unset
    assert Config().averaging.error_feedback([(3, 2)]).decay == 1.0  # type: ignore[union-attr]  # int4
    avg = load_config(
        None,
        ["averaging.compression=topk", "averaging.topk_density=0.03125", "averaging.topk_chunk=1024",
         "averaging.topk_value_bits=4", "averaging.ef_decay=0.9"],
    ).averaging  # fmt: skip
    codec = avg.wire_codec()
    assert isinstance(codec, TopKCodec) and (codec.chunk, codec.k, codec.value_bits) == (1024, 32, 4)
    assert avg.feedback_decay() == 0.9
    for override, message in [
        (
            "averaging.topk_chunk=1000",
            "averaging.topk_chunk must be a power of two from 16 to 65536, got 1000",
        ),
        (
            "averaging.topk_chunk=131072",
            "averaging.topk_chunk must be a power of two from 16 to 65536, got 131072",
        ),
        ("averaging.topk_density=0", "averaging.topk_density must be a fraction in (0, 1], got 0.0"),
        ("averaging.topk_density=1.5", "averaging.topk_density must be a fraction in (0, 1], got 1.5"),
        ("averaging.topk_value_bits=3", "averaging.topk_value_bits must be one of 2, 4, 8, got 3"),
        ("averaging.ef_decay=0", "averaging.ef_decay must be in (0, 1], got 0.0"),
        ("averaging.ef_decay=1.01", "averaging.ef_decay must be in (0, 1], got 1.01"),
    ]:
        assert config_error(overrides=["averaging.compression=topk", override]) == message


def test_the_error_feedback_residual_follows_the_codec_and_residual_dtype() -> None:
    shapes = [(3, 2)]
    residual = Config().averaging.error_feedback(shapes)
    assert residual is not None and residual.residual[0].dtype == torch.bfloat16  # int4 by default
    exact = load_config(None, ["averaging.residual_dtype=float32"]).averaging.error_feedback(shapes)
    assert exact is not None and exact.residual[0].dtype == torch.float32
    assert load_config(None, ["averaging.compression=int8"]).averaging.error_feedback(shapes) is None
    message = config_error(overrides=["averaging.residual_dtype=float16"])
    assert message == "averaging.residual_dtype must be one of bfloat16, float32, got 'float16'"
