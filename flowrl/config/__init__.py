"""The configuration: one dataclass tree (a docstring per field), YAML presets, `key=value` overrides.

    from flowrl.config import load_config
    cfg = load_config("configs/tiny_cpu.yaml", ["train.lr=1e-4", "train.objective=nft"])

`tree` holds the sections (each objective adds its own, `train.<name>`), `load` reads YAML and overrides (other
tools' names, keys that moved), `checks` validates a built config once, before any work starts: an unknown key is an
error naming the closest valid keys, a value of the wrong type or outside its choices names what would be right.
"""

from flowrl.errors import ConfigError, ConfigWarning
from flowrl.ranges import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range

from .checks import RANGES, range_problems, validate
from .load import (
    ALIASES,
    LOSS_PRESETS,
    MOVED_KEYS,
    load_config,
    migrate,
    moved_key,
    parse_overrides,
    read_yaml,
    to_dict,
    without_other_objectives,
)
from .tree import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    RewardSpec,
    RolloutConfig,
    SampleConfig,
    TextConfig,
    TrainConfig,
    describe,
    field_docs,
    section_ranges,
)

__all__ = [
    "ALIASES",
    "AT_LEAST_0",
    "AT_LEAST_1",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "EvalConfig",
    "FRACTION",
    "LOSS_PRESETS",
    "LogConfig",
    "LoraConfig",
    "MOVED_KEYS",
    "ModelConfig",
    "POSITIVE",
    "RANGES",
    "Range",
    "RewardSpec",
    "RolloutConfig",
    "SampleConfig",
    "TextConfig",
    "TrainConfig",
    "describe",
    "field_docs",
    "load_config",
    "migrate",
    "moved_key",
    "parse_overrides",
    "range_problems",
    "read_yaml",
    "section_ranges",
    "to_dict",
    "validate",
    "without_other_objectives",
]
