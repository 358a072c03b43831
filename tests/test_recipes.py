"""The parts of a training recipe (issue 20), in one process: learning-rate schedules and their
resume, validation, TensorBoard, the rules on their keys. Their multi-process twins ride on the
launches of ``test_train_e2e.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardgraph import PlanError
from shardgraph.train import loads_pipeline, train
from shardgraph.train.schedule import lr_factor

BASE = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 128
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
[data]
seq_len = 16
[train]
steps = 8
global_batch_size = 4
micro_batch_size = 2
optimizer = "adamw"
weight_decay = 0.1
grad_clip = 0.5
lr = 0.01
seed = 1
{train}
{extra}
"""


def pipeline(train_keys: str = "", extra: str = ""):
    return loads_pipeline(BASE.format(train=train_keys, extra=extra))


@pytest.mark.parametrize("keys, want", [
    ('lr_schedule = "constant"', [1.0] * 8),
    ('lr_schedule = "constant"\nwarmup_steps = 4', [0.25, 0.5, 0.75] + [1.0] * 5),
    # after 2 warmup steps, 6 decay steps down to min_lr = lr / 10: 1 - 0.9 * k / 6
    ('lr_schedule = "linear"\nwarmup_steps = 2\nmin_lr = 0.001',
     [0.5, 1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1]),
    # cosine over 4 steps from 1 to 0: (1 + cos(pi k / 4)) / 2
    ('lr_schedule = "cosine"\nwarmup_steps = 4',
     [0.25, 0.5, 0.75, 1.0, 0.8535534, 0.5, 0.1464466, 0.0]),
    # warmup 2, stable, the last 3 steps decay linearly to 0
    ('lr_schedule = "wsd"\nwarmup_steps = 2\ndecay_steps = 3',
     [0.5, 1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0]),
])
def test_schedules(keys, want):
    factor = lr_factor(pipeline(keys).train)
    assert [factor(s) for s in range(8)] == pytest.approx(want, abs=1e-6)
    assert factor(12) == pytest.approx(want[-1])  # --steps past [train] steps: the final value


@pytest.mark.parametrize("keys, key", [
    ('lr_schedule = "cosin"', "train.lr_schedule"),
    ("warmup_steps = 9", "train.warmup_steps"),
    ("warmup_steps = -1", "train.warmup_steps"),
    ("min_lr = 0.1", "train.min_lr"),
    ('lr_schedule = "cosine"\ndecay_steps = 2', "train.decay_steps"),
    ('lr_schedule = "wsd"', "train.decay_steps"),
    ('lr_schedule = "wsd"\nwarmup_steps = 4\ndecay_steps = 5', "train.decay_steps"),
])
def test_bad_schedules_are_plan_errors(keys, key):
    with pytest.raises(PlanError) as err:
        pipeline(keys)
    assert key in err.value.keys


def test_a_cosine_run_resumed_in_warmup_and_in_decay_is_the_uninterrupted_run(tmp_path):
    keys = 'lr_schedule = "cosine"\nwarmup_steps = 4\nmin_lr = 0.001'
    whole = train(pipeline(keys))["rows"]
    assert [r["lr"] for r in whole] == pytest.approx(
        [0.01 * lr_factor(pipeline(keys).train)(s) for s in range(8)], rel=1e-12)
    ckpt = f'[checkpoint]\ndir = "{tmp_path / "ckpt"}"'
    rows = train(pipeline(keys, ckpt), steps=2)["rows"]  # stops in warmup
    rows += train(pipeline(keys, ckpt), steps=6)["rows"]  # resumes in warmup, stops in decay
    meta = json.loads((tmp_path / "ckpt" / "step_00000006" / "meta.json").read_text())
    assert meta["lr_scheduler"]["last_epoch"] == 6  # the position is in the checkpoint
    rows += train(pipeline(keys, ckpt))["rows"]  # resumes in decay
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["lr"] for r in rows] == [r["lr"] for r in whole]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in whole], abs=1e-6)
