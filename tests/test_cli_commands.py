"""The command table: ``shardgraph --help`` in users' words, each command imported only when
named, one meaning of ``--world-size`` everywhere, ``export``'s process count, and a closed pipe."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardgraph.cli import COMMANDS, build_parser, main
from tests import _dist

ROOT = Path(__file__).parents[1]
LLAMA_70B = str(ROOT / "examples" / "llama3_70b_dryrun.toml")
TINY = """
[plugins.fsdp2]
[plugins.tp]
size = 2
[mesh]
world_size = 4
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 64
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
[data]
seq_len = 8
[train]
global_batch_size = 8
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return str(path)


def test_help_lists_every_command_on_one_line_in_users_words(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name, command in COMMANDS.items():
        assert f"  {name:<10}{command.help}" in lines, name
        assert len(f"  {name:<10}{command.help}") <= 79, name
    for internal in ("COMMANDS", "register", "module", "import"):
        assert internal not in out, internal
    assert main([]) == 2  # no command: the same listing, on stderr
    assert "  train     " in capsys.readouterr().err


def test_help_and_the_light_commands_import_neither_torch_nor_transformers(tmp_path):
    probe = ("import sys; from shardgraph.cli import main\n"
             "try: main(sys.argv[1:])\nexcept SystemExit: pass\n"
             "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules),"
             " file=sys.stderr)")
    for args in (["--help"], ["estimate", "--help"],
                 ["estimate", LLAMA_70B, "--world-size", "64", "--json"]):
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "HEAVY []" in done.stderr, (args, done.stderr)


def test_each_command_is_found_in_its_module_and_nothing_registers_itself():
    for name, command in COMMANDS.items():
        arguments, run = command.load()
        assert callable(arguments) and callable(run), name
        assert build_parser(name).parse_args([name, "f", "g", "h"] if name == "export" else
                                             [name, "f"] if name != "plugins" else [name]).run \
            is run
    # No module reaches into the CLI's table: the only name taken from shardgraph.cli is the
    # entry point ``main`` (``python -m shardgraph.train``).
    for path in (ROOT / "shardgraph").rglob("*.py"):
        package = path.relative_to(ROOT).with_suffix("").parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else ()
                module = ".".join((*base, *(node.module or "").split(".")))
                if module == "shardgraph.cli":
                    assert [a.name for a in node.names] == ["main"], path


@pytest.mark.parametrize("flag", ["--world-size", "--gpus-per-node"])
@pytest.mark.parametrize("command", ["plan", "explain", "estimate", "dryrun"])
def test_world_size_flags_are_documented(command, flag, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    if command == "dryrun" and flag == "--gpus-per-node":
        return  # a dry run simulates one rank: nodes do not enter it
    assert flag in out and "[mesh]" in out


def test_estimate_and_dryrun_take_a_world_size_other_than_the_file_s(tiny, capsys):
    # The file says [mesh] world_size = 4; --world-size wins, as it does for plan and explain.
    assert main(["plan", tiny, "--world-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 8
    assert main(["estimate", tiny, "--world-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sizes"]["dp_shard"] == 4
    assert main(["dryrun", tiny, "--world-size", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 8 and report["sizes"]["dp_shard"] == 4
    assert main(["dryrun", tiny, "--json"]) == 0  # and without it, the file's
    assert json.loads(capsys.readouterr().out)["world_size"] == 4
    # the 70B example on 64 GPUs: no edited copy of the file needed
    assert main(["estimate", LLAMA_70B, "--world-size", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] in (True, False)


@pytest.mark.parametrize("command", ["estimate", "dryrun"])
def test_a_world_size_that_does_not_divide_names_the_flag(command, tiny, capsys):
    assert main([command, tiny, "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "[world-size] --world-size" in err and "mesh.world_size" not in err
    assert "--nproc" not in err  # a flag these commands do not have


def test_export_names_nproc_and_defaults_to_the_file_s_world_size(tiny, tmp_path, capsys):
    assert _dist.command("export", tiny, str(tmp_path / "step_1"), str(tmp_path / "out"),
                         "--nproc", "3") == 2
    err = capsys.readouterr().err
    assert "[world-size] --nproc" in err and "mesh.world_size" not in err, err
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "default: [mesh] world_size" in " ".join(capsys.readouterr().out.split())


def test_a_closed_pipe_ends_the_command_quietly():
    # `shardgraph explain ... | head -1`: the reader is gone before the output is written
    proc = subprocess.Popen([sys.executable, "-m", "shardgraph.cli", "explain",
                             str(ROOT / "examples" / "default.toml"), "--world-size", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_plan_lists_each_step_once_and_says_what_a_step_uses(capsys):
    assert main(["plan", str(ROOT / "examples" / "default.toml"), "--world-size", "4"]) == 0
    steps = [line.split(". ", 1)[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("  ") and line.strip()[:1].isdigit()]
    # each plugin once; what a step takes from another is said as such (tp + sp read
    # "2. tp + sp (sequence_parallel)", then "3. sp", as if sp ran twice)
    assert [step.split()[0] for step in steps] == ["tp", "sp", "activation_checkpointing",
                                                   "fsdp2"]
    # (tp reads checkpointing and sp only to count the collectives they change) what it reads,
    # not the capability's name, which is often the plugin's ("uses activation_checkpointing
    # from activation_checkpointing")
    assert steps[0] == ("tp  (uses the recomputation regions of activation_checkpointing; "
                        "the sequence sharding of sp)") and "+" not in "".join(steps)
    assert steps[1] == ("sp  (uses the recomputation regions of activation_checkpointing; "
                        "the tensor-parallel layout of tp)")


def test_plugins_shows_every_option_doc_whole(capsys):
    assert main(["plugins", "--json"]) == 0
    docs = {(p["name"], o["name"]): o["doc"]
            for p in json.loads(capsys.readouterr().out)["plugins"] for o in p["options"]}
    assert not [k for k, doc in docs.items() if doc.endswith((",", ":", ";"))]
    assert docs["pp", "schedule"].endswith("or a torch schedule class name")


def test_commands_that_read_no_data_run_where_the_data_is_not(tmp_path, capsys):
    """estimate, plan --auto and dryrun read no data: sizing a cluster's job on a laptop, its
    data paths need not exist here; training (the default loader) still refuses them, every
    one at once."""
    from shardgraph import load_pipeline
    from shardgraph.core.errors import PlanError

    away = tmp_path / "on-the-cluster"
    path = tmp_path / "elsewhere.toml"
    path.write_text(TINY.replace("[data]\n", f'[data]\npath = "{away / "train.jsonl"}"\n'
                                 f'tokenizer = "{away / "tokenizer"}"\n')
                    + f'[validation]\npath = "{away / "val.jsonl"}"\n')
    for args in (["estimate", str(path), "--json"], ["plan", str(path), "--auto", "--json"],
                 ["dryrun", str(path), "--json"]):
        assert main(args) == 0, capsys.readouterr().err
        json.loads(capsys.readouterr().out)
    with pytest.raises(PlanError) as raised:
        load_pipeline(path)
    keys = {k for v in raised.value.violations for k in v.keys}
    assert {"data.path", "data.tokenizer", "validation.path"} <= keys, keys


def test_optional_libraries_messages_no_user_acts_on_are_dropped():
    """torchao's warning for each CUDA kernel library a CPU machine cannot load, and torch's
    deprecation of the Enums torchao registers with pytree, are dropped where they are logged;
    their other messages pass."""
    import logging

    import torch

    from shardgraph.core import quiet

    quiet.install()
    quiet.install()  # once is enough: no second filter
    said: list[str] = []

    class Keep(logging.Handler):  # torch's loggers do not propagate to the root's
        def emit(self, record):
            said.append(record.getMessage())

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    assert all(sum(isinstance(f, quiet._Drop) for f in lg.filters) == 1 for lg in loggers)
    keep = Keep()
    for lg in loggers:
        lg.addHandler(keep)
    try:
        loggers[0].warning("Failed to load /x/torchao/_C_mxfp8.so: no CUDA")
        loggers[0].warning("something else torchao says")
        loggers[1].warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
            "value type. Calling register_constant() on Enum subclasses is deprecated and will "
            "be an error in a future release.", "<enum 'X'>")
        loggers[1].warning("another pytree warning")
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
    kernels = [m for m in said if m.startswith("Failed to load")]
    assert len(kernels) == (1 if torch.cuda.is_available() else 0), said
    assert "something else torchao says" in said and "another pytree warning" in said
    assert not any("register_constant" in m for m in said)
    # a one-process load or save of torch's distributed checkpoint: its warning and its log
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install()
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming "
                      "the intent is to load in a single process.", UserWarning)
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]
    consolidate = logging.getLogger("torch.distributed.checkpoint._consolidate_hf_safetensors")
    assert any(isinstance(f, quiet._Drop) for f in consolidate.filters)
    record = consolidate.makeRecord(consolidate.name, logging.WARNING, __file__, 0,
                                    "Distributed environment not initialized. Running in "
                                    "single process mode.", (), None)
    assert not consolidate.filter(record)


def test_a_command_that_builds_a_model_says_nothing_of_torchaos_kernels():
    """Where torchao is installed (float8's extra; the dev install has it), importing
    transformers' models, as dryrun, export and every training worker do, logs torchao's
    kernel libraries a CPU machine cannot load; shardgraph's processes do not show them."""
    pytest.importorskip("torchao", reason="torchao is float8's extra: not installed here")
    probe = ("import sys\nif sys.argv[1] == 'quiet':\n    from shardgraph.core import quiet\n"
             "import transformers.modeling_utils\n")

    def stderr(mode: str) -> str:
        done = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr

    loud = stderr("loud")
    if "Failed to load" not in loud and "register_constant" not in loud:
        pytest.skip("torchao loads its kernels here and torch does not warn: nothing to drop")
    quiet = stderr("quiet")
    assert "Failed to load" not in quiet and "register_constant" not in quiet, quiet


def _write(tmp_path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def test_a_file_that_is_not_utf8_text_is_refused_and_a_byte_order_mark_is_read(tmp_path,
                                                                              capsys):
    assert main(["plan", _write(tmp_path, "bin.toml", b"\xff\xfe[plugins.fsdp2]\n")]) == 2
    err = capsys.readouterr().err
    assert "[file]" in err and "is not UTF-8 text" in err and "Traceback" not in err, err
    bom = _write(tmp_path, "bom.toml", "\ufeff" + TINY)
    assert main(["plan", bom, "--json"]) == 0, capsys.readouterr().err


def test_input_that_crashed_a_command_is_refused_with_its_key(tmp_path, capsys):
    """Each of these printed a traceback (or, for train, started its workers first)."""
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    cases = [
        (["estimate", _write(tmp_path, "a.toml", TINY.replace(
            '[model]\narchitecture = "LlamaForCausalLM"\n[model.config]\n',
            f'[model]\npath = "{listed}"\n[model.config]\n'))], "model.path"),
        (["plan", _write(tmp_path, "b.toml", TINY.replace("[plugins.fsdp2]\n[plugins.tp]\nsize = 2\n",
                                                         "[plugins.ddp]\nbucket_cap_mb = nan\n"))],
         "plugins.ddp.bucket_cap_mb"),
        (["dryrun", _write(tmp_path, "c.toml", TINY.replace("hidden_size = 32",
                                                           "hidden_size = 30"))],
         "model.config"),
        (["dryrun", _write(tmp_path, "d.toml", TINY), "--world-size", "0"], "--world-size"),
    ]
    odd_cp = _write(tmp_path, "e.toml", TINY.replace("[plugins.tp]\nsize = 2\n",
                                                     "[plugins.cp]\nsize = 2\n")
                    .replace("seq_len = 8", "seq_len = 10"))
    cases += [([command, odd_cp], "data.seq_len, plugins.cp.size")
              for command in ("estimate", "dryrun", "train")]
    for args, key in cases:
        assert _dist.command(*args) == 2, args
        err = capsys.readouterr().err
        assert f"] {key}:" in err and "Traceback" not in err, (args, err)


def test_zero_gpus_a_node_is_refused_by_name_and_a_preset_is_found_by_its_start(tmp_path,
                                                                                capsys):
    """estimate and plan --auto took --gpus-per-node 0 (and [mesh] gpus_per_node = 0) as
    unset; --gpu H100 suggested H200, not H100-SXM."""
    zero = _write(tmp_path, "zero.toml", TINY.replace("world_size = 4",
                                                      "world_size = 4\ngpus_per_node = 0"))
    for args, key in ((["estimate", _write(tmp_path, "t.toml", TINY), "--gpus-per-node", "0"],
                       "--gpus-per-node"),
                      (["plan", "--auto", str(tmp_path / "t.toml"), "--gpus-per-node", "0"],
                       "--gpus-per-node"),
                      (["estimate", zero], "mesh.gpus_per_node"),
                      (["plan", "--auto", zero], "mesh.gpus_per_node")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert f"[size] {key}: {key} must be a positive integer" in err, (args, err)
    assert main(["estimate", str(tmp_path / "t.toml"), "--gpu", "H100"]) == 2
    assert "did you mean 'H100-SXM'?" in capsys.readouterr().err


def test_train_refuses_outputs_it_could_not_write_before_it_starts(tmp_path, capsys):
    directory = tmp_path / "metrics"
    directory.mkdir()
    a_file = _write(tmp_path, "traces", "")
    assert _dist.command("train", _write(tmp_path, "t.toml", TINY), "--steps", "2",
                         "--metrics", str(directory), "--profile", "1:1", "--profile-dir",
                         a_file) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "--metrics" in err and "--profile-dir" in err, err


def test_plan_of_a_huge_world_does_not_list_its_process_groups(capsys):
    """``plan`` prints the steps and the mesh; it built every process group of the world and
    threw them away (16M ranks: 82 s and 2.9 GB)."""
    import time

    began = time.process_time()
    assert main(["plan", str(ROOT / "examples" / "default.toml"),
                 "--world-size", str(2**24)]) == 0
    assert time.process_time() - began < 10
    out = capsys.readouterr().out
    assert "dp_shard=8388608" in out and "process groups" not in out


def test_a_misspelt_size_is_one_problem_not_two(tmp_path, capsys):
    """``[plugins.tp] sise = 2``: the unknown key, with the right spelling; not also 'tp has
    size 1, set size > 1' (true, but advice for another mistake)."""
    text = TINY.replace("[plugins.tp]\nsize = 2\n", "[plugins.tp]\nsise = 2\n")
    assert main(["plan", _write(tmp_path, "sise.toml", text)]) == 2
    err = capsys.readouterr().err
    assert "1 problem" in err and "did you mean 'size'?" in err and "inactive" not in err, err


def test_a_checkpoint_given_by_resume_is_named_resume(tmp_path, capsys):
    """``train --resume DIR`` where DIR is not a complete checkpoint: the problem names the flag
    the user gave, not the file's checkpoint.resume."""
    empty = tmp_path / "step_00000010"
    empty.mkdir()
    assert _dist.command("train", _write(tmp_path, "t.toml", TINY), "--resume", str(empty)) == 2
    err = capsys.readouterr().err
    assert "] --resume:" in err and "checkpoint.resume" not in err, err


def _reported(args: list[str], capsys) -> tuple[set[str], set[str]]:
    """The (rules, keys) of the one report a refused command prints."""
    assert _dist.command(*args) == 2, args
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line.split("] ", 1) for line in err.splitlines() if line.startswith("  - [")]
    return ({rule.removeprefix("  - [") for rule, _ in lines},
            {k for _, rest in lines for k in rest.split(": ", 1)[0].split(", ")})


def test_every_cluster_problem_comes_in_one_report(tmp_path, capsys):
    """A wrong type, an unknown GPU, 0 GPUs a node and a negative HBM took four rounds."""
    path = _write(tmp_path, "c.toml", TINY + '[cluster]\ngpu = "H100X"\nhbm_gib = -1\n'
                  'gpus_per_node = 0\nnetwork_gbps = "x"\n')
    cluster = {"cluster.gpu", "cluster.hbm_gib", "cluster.gpus_per_node", "cluster.network_gbps"}
    for args, extra in ((["estimate", path, "--world-size", "8"], set()),
                        (["plan", "--auto", path, "--world-size", "8", "--top", "0"],
                         {"--top"})):
        assert _reported(args, capsys)[1] == cluster | extra, args


def test_training_sections_hide_no_problem_of_the_plan(tmp_path, capsys):
    """estimate, dryrun, export and train stopped at [train]; the sp/ddp conflict came next
    round."""
    path = _write(tmp_path, "t.toml", TINY.replace(
        "[plugins.fsdp2]\n[plugins.tp]\nsize = 2\n", "[plugins.ddp]\n[plugins.sp]\n")
        .replace("global_batch_size = 8", "global_batch_size = -1"))
    for args in (["estimate", path], ["dryrun", path], ["train", path],
                 ["export", path, str(tmp_path / "no-ckpt"), str(tmp_path / "out")]):
        rules, keys = _reported(args, capsys)
        assert {"value", "conflicts", "requires"} <= rules, args
        assert "train.global_batch_size" in keys, args


def test_command_line_problems_hide_no_problem_of_the_file(tmp_path, capsys):
    path = _write(tmp_path, "u.toml", TINY.replace("[plugins.tp]", "[plugins.tpx]"))
    assert _reported(["plan", path, "--auto", "--top", "0", "--world-size", "8"],
                     capsys)[1] == {"--top", "plugins.tpx"}


def test_a_misspelt_model_key_hides_no_rule_of_the_plan_on_the_keys_given(tmp_path, capsys):
    """The model is built without the key it refused: tp's head rule on the heads the user gave
    comes in the same report (a rule on a default is left out: it may be what the key meant)."""
    path = _write(tmp_path, "m.toml", TINY.replace("hidden_size = 32",
                                                   "hidden_size = 48\nhidden_sizee = 64")
                  .replace("num_attention_heads = 4", "num_attention_heads = 3")
                  .replace("num_key_value_heads = 2", "num_key_value_heads = 3"))
    for args in (["dryrun", path], ["train", path, "--nproc", "4"]):
        keys = _reported(args, capsys)[1]
        assert {"model.config.hidden_sizee", "model.config.num_attention_heads"} <= keys, args


def test_estimate_refuses_the_models_dryrun_and_train_cannot_build(tmp_path, capsys):
    """hidden_size 63 over 4 heads (Llama's config refuses it) and a config.json of a model
    type no family has were estimated (or blamed on model.architecture, the user's '?')."""
    odd = _write(tmp_path, "odd.toml", TINY.replace("hidden_size = 32", "hidden_size = 63"))
    for command in (["estimate", odd], ["plan", odd, "--auto"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "[model] model.config: LlamaForCausalLM cannot be built from this config: " \
            "hidden_size = 63 is not a multiple of num_attention_heads = 4" in err, err
        assert "fix: set hidden_size to a multiple of 4 (e.g. 64), or num_attention_heads to a " \
            "divisor of 63 (3, 1) in [model.config]" in err
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text('{"model_type": "bert", "hidden_size": 32}')
    path = _write(tmp_path, "bert.toml", TINY.replace(
        '[model]\narchitecture = "LlamaForCausalLM"\n[model.config]\n',
        f'[model]\npath = "{bert}"\n[model.config]\n'))
    assert main(["estimate", path]) == 2
    err = capsys.readouterr().err
    assert f"[model] model.path: {bert / 'config.json'} names model_type 'bert': no model " \
        "family the planner knows" in err and "model.architecture" not in err
    assert "fix: point model.path at a model of one of LlamaForCausalLM, " in err


def test_estimate_of_a_pipeline_over_a_model_without_layers_says_to_give_it_layers(tmp_path,
                                                                                    capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 0, "intermediate_size": 64, "vocab_size": 64}))
    path = _write(tmp_path, "p.toml", TINY.replace(
        '[model]\narchitecture = "LlamaForCausalLM"\n[model.config]\n',
        f'[model]\npath = "{empty}"\n[model.config]\n').replace(
        "num_hidden_layers = 2\n", "").replace("[plugins.tp]\nsize = 2\n",
                                               "[plugins.pp]\nsize = 2\nmicrobatch_size = 1\n"))
    assert main(["estimate", path]) == 2
    err = capsys.readouterr().err
    assert "2 pipeline stages but the model has no layers" in err
    assert "fix: give the model at least 2 layers (num_hidden_layers), or remove pp" in err


@pytest.mark.parametrize("command", ["plan", "estimate", "train"])
def test_a_named_pipe_or_a_directory_is_refused_not_waited_on(command, tmp_path):
    """Opening a FIFO waits for a writer forever: it is told apart before it is opened (run in
    a child with a timeout, so that a regression fails instead of hanging the suite)."""
    import os

    fifo = tmp_path / "p.toml"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a named pipe (FIFO)"), (tmp_path, "a directory")):
        code = "import sys; from shardgraph.cli import main; sys.exit(main(sys.argv[1:]))"
        done = subprocess.run([sys.executable, "-c", code, command, str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"[file] {path}: {path} is {kind}, not a pipeline file" in done.stderr
        assert "fix: give the path of a pipeline's TOML file (a regular file)" in done.stderr
        assert "Traceback" not in done.stderr


def test_options_that_would_be_ignored_are_refused_by_name(tiny, capsys):
    """plan --top / --gpu without --auto, --top 0, an empty --gpu, an empty --svg: each was
    silently ignored (the default GPU, no picture, the one plan)."""
    assert main(["plan", tiny, "--top", "0", "--gpu", "H200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardgraph plan: 3 problems in the command line:")
    for flag in ("--top", "--gpu"):
        assert f"[option] {flag}, --auto: {flag} is read only with --auto" in err
        assert f"fix: add --auto to rank plans, or remove {flag}" in err
    assert "[value] --top: --top must be >= 1, got 0" in err
    assert main(["plan", tiny, "--auto", "--top", "0"]) == 2
    assert "[value] --top: --top must be >= 1, got 0" in capsys.readouterr().err
    for command in (["estimate", tiny, "--gpu", ""], ["plan", tiny, "--auto", "--gpu", ""]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "[value] --gpu: --gpu names no GPU (it is empty)" in err
        assert "fix: valid: 'A100-40GB', " in err
    assert main(["explain", tiny, "--svg", ""]) == 2
    err = capsys.readouterr().err
    assert "[value] --svg: --svg was given an empty file name" in err
    assert "fix: give the file to write, e.g. --svg plan.svg, or leave --svg out" in err


def test_estimate_of_a_distributed_form_file_names_its_keys(tmp_path, capsys):
    """The planner's model and batch rules named plugins.tp.size and
    plugins.pp.microbatch_size, keys a [distributed] file does not have."""
    path = _write(tmp_path, "d.toml", "[distributed]\ntp_size = 8\npp_size = 2\n"
                  "[distributed.pipeline]\npp_microbatch_size = 3\n[mesh]\nworld_size = 16\n"
                  "[model.config]\nnum_attention_heads = 4\n[train]\nglobal_batch_size = 8\n")
    assert main(["estimate", path]) == 2
    err = capsys.readouterr().err
    assert "[option] distributed.pipeline.pp_microbatch_size, train.global_batch_size: " in err
    assert "[tp-divisible] model.config.num_attention_heads, distributed.tp_size: " in err
    assert "plugins." not in err


def test_a_model_the_planner_has_no_shape_for_comes_with_the_plans_problems(tmp_path, capsys):
    """A Phi model and tp 3 on 8 ranks: the planner's missing shape came a round after the
    plan's problems in estimate, and after the options' in plan --auto."""
    path = _write(tmp_path, "p.toml", '[model]\narchitecture = "PhiForCausalLM"\n'
                  "[plugins.fsdp2]\n[plugins.tp]\nsize = 3\n")
    rules, keys = _reported(["estimate", path, "--world-size", "8"], capsys)
    assert {"within-node", "world-size", "model"} <= rules, rules
    assert "model.architecture" in keys
    rules, keys = _reported(["plan", path, "--auto", "--world-size", "8", "--top", "0"], capsys)
    assert {"model", "value"} <= rules and {"model.architecture", "--top"} <= keys, keys


def test_estimate_says_a_pipelines_microbatch_problem_in_trains_words(tmp_path, capsys):
    """Microbatches of 4 of a local batch of 4 cannot fill pp = 2 stages. estimate said so with
    its own copy of the rule ([batch], "a local batch of 4 sequences in microbatches of 4"),
    train and dryrun with pp's; estimate now compiles with the local batch as they do."""
    text = (ROOT / "examples" / "pp_fsdp2.toml").read_text()
    path = _write(tmp_path, "pp.toml", text.replace("microbatch_size = 2", "microbatch_size = 4"))
    said = {}
    for command in ("estimate", "dryrun", "train"):
        assert _dist.command(command, path) == 2, command
        said[command] = capsys.readouterr().err.split(":\n", 1)[1]
    assert said["estimate"] == said["dryrun"] == said["train"] == (
        "  - [option] plugins.pp.microbatch_size, train.global_batch_size: 1 microbatches "
        "cannot fill 2 pipeline stages (the local batch: train.global_batch_size / dp = 8 / 2 "
        "= 4)\n    fix: make local_batch_size / microbatch_size >= pp = 2\n")


def test_estimate_refuses_a_local_batch_the_loop_does_not_train_on_as_train_does(tmp_path,
                                                                                  capsys):
    """[step_scheduler] local_batch_size = 8 where each of dp = 4 ranks trains on 8 / 4 = 2:
    train and dryrun named it, estimate said instead that 2 sequences in microbatches of 2
    cannot fill pp = 2 stages (its own batch rule, on the batch the file did not give)."""
    text = (ROOT / "examples" / "pp_fsdp2.toml").read_text()
    path = _write(tmp_path, "l.toml", text.replace("world_size = 4", "world_size = 8")
                  + "[step_scheduler]\nlocal_batch_size = 8\n")
    problem = ("  - [batch] step_scheduler.local_batch_size, train.global_batch_size, {}: "
               "step_scheduler.local_batch_size = 8 but each of dp = 4 ranks trains on "
               "global_batch_size / dp = 8 / 4 = 2 sequences\n    fix: set "
               "step_scheduler.local_batch_size = 2, or remove it (train.global_batch_size "
               "sizes the local batch)\n")
    for args, world in ((["estimate", path], "--world-size"), (["dryrun", path], "--world-size"),
                        (["train", path], "--nproc")):
        assert _dist.command(*args) == 2, args
        err = capsys.readouterr().err
        assert err.endswith(":\n" + problem.format(world)), (args, err)  # that one, alone
