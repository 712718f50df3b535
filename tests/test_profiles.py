from pathlib import Path

import pytest

from specchat import cli
from specchat.profiles import DEFAULT_PROFILE, ProfileError, load_profiles


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def user_dir(isolated_dirs):
    return isolated_dirs / "user-profiles"


def test_shipped_profiles_all_load():
    ps = load_profiles()
    assert DEFAULT_PROFILE in ps.profiles
    # A profile whose drafter is not trained yet says so and how to get one; nothing else may fail.
    for name, msg in ps.errors.items():
        assert "no drafter at" in msg and "specchat train" in msg, msg


def test_user_profile_overrides_shipped_and_extends(user_dir):
    write(user_dir, "smollm2", "backend: llamacpp\nmodel: smollm2-135m-instruct\ndescription: mine\n"
                               "sampling: {temperature: 0.5, top_k: 10}\n")
    write(user_dir, "child", "extends: smollm2\nsampling: {temperature: 0.9}\n")
    ps = load_profiles()
    assert ps.profiles["smollm2"].description == "mine"
    child = ps.profiles["child"]
    assert child.sampling.temperature == 0.9
    assert child.sampling.top_k == 10  # deep-merged from the parent
    assert child.backend == "llamacpp" and child.name == "child"


@pytest.mark.parametrize("text, expected", [
    ("model: m\nbackend: torch\ntemprature: 1\n", "temprature: unknown key"),
    ("model: m\nsampling: {temperature: hot}\n", "sampling.temperature"),
    ("model: m\nsampling: {top_p: 1.5}\n", "sampling.top_p"),
    ("model: m\nbackend: vllm\n", "backend"),
    ("backend: torch\n", "model: required key is missing"),
    ("model: m\nbackend: llamacpp\nspeculative: {method: ngram}\n", "needs backend 'torch'"),
    ("model: m\nspeculative: {method: draft}\n", "needs `drafter`"),
    ("model: m\nspeculative: {method: ngram, lookup: 4}\n", "in front of a model drafter"),
    ("model: m\nspeculative: {method: draft, drafter: ./d, copy_depth: 8}\n", "lengthens prompt-lookup drafts"),
    ("model: ./missing.gguf\n", "model: no file or directory"),
    ("model: m\nspeculative: {method: draft, drafter: ./nowhere}\n", "speculative.drafter: no drafter"),
    ("model: m\n  bad: [\n", "broken YAML at line"),
    ("- a\n- b\n", "expected a mapping"),
    ("", "the file is empty"),
    ("extends: nobody\nmodel: m\n", "extends: no profile named 'nobody'"),
    ("name: other\nmodel: m\n", "differs from the file name"),
])
def test_validation_is_one_clear_line_and_others_still_load(user_dir, text, expected):
    path = write(user_dir, "broken", text)
    ps = load_profiles()
    msg = ps.errors["broken"]
    assert expected in msg
    assert str(path) in msg
    assert "\n" not in msg and "Traceback" not in msg
    assert DEFAULT_PROFILE in ps.profiles  # the rest still load
    with pytest.raises(ProfileError, match="broken"):
        ps.get("broken")


def test_extends_cycle_is_reported(user_dir):
    write(user_dir, "a", "extends: b\nmodel: m\n")
    write(user_dir, "b", "extends: a\nmodel: m\n")
    assert "cycle" in load_profiles().errors["a"]


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ProfileError, match="no profile named 'nope'.*smollm2"):
        load_profiles().get("nope")


def test_relative_paths_resolve_against_the_profile_file(user_dir, tmp_path):
    (user_dir / "models").mkdir(parents=True)
    (user_dir / "models" / "m.gguf").write_bytes(b"GGUF")
    p = write(user_dir, "local", "model: ./models/m.gguf\nbackend: llamacpp\n")
    prof = load_profiles().profiles["local"]
    assert prof.resolve_path(prof.model) == p.parent / "models" / "m.gguf"


def test_a_profile_extending_a_shipped_one_finds_the_parents_files(user_dir):
    # smollm2-mtp (shipped) names its head ./drafters/smollm2-mtp, relative to the shipped folder
    shipped = load_profiles().profiles["smollm2-mtp"]
    write(user_dir, "mine", "extends: smollm2-mtp\nspeculative: {lookup: 4}\n")
    write(user_dir, "own-head", "extends: smollm2-mtp\nspeculative: {drafter: ./heads/h}\n")
    (user_dir / "heads" / "h").mkdir(parents=True)
    ps = load_profiles()
    mine = ps.profiles["mine"]
    assert mine.resolve_path(mine.speculative.drafter) == shipped.resolve_path(shipped.speculative.drafter)
    assert mine.speculative.lookup == 4 and mine.speculative.depth == shipped.speculative.depth
    own = ps.profiles["own-head"]  # a path the child writes itself stays relative to the child
    assert own.resolve_path(own.speculative.drafter) == user_dir / "heads" / "h"


def test_target_only_and_overrides():
    prof = load_profiles().get(DEFAULT_PROFILE)
    ref = prof.target_only()
    assert ref.method == "none" and ref.model == prof.model
    assert prof.with_overrides(temperature=0.7, seed=None).sampling.temperature == 0.7
    with pytest.raises(ProfileError, match="sampling.temperature"):
        prof.with_overrides(temperature=-1)


def test_overrides_by_dotted_key_are_validated():
    prof = load_profiles().get("smollm2-ngram")
    changed = prof.with_overrides({"speculative.depth": 6, "dtype": "bfloat16"}, temperature=0.5)
    assert changed.speculative.depth == 6 and changed.dtype == "bfloat16" and changed.sampling.temperature == 0.5
    assert prof.speculative.depth != 6 or prof.dtype != "bfloat16"  # the original is untouched
    with pytest.raises(ProfileError, match="speculative.depht: unknown key"):
        prof.with_overrides({"speculative.depht": 3})
    with pytest.raises(ProfileError, match="speculative.depth"):
        prof.with_overrides({"speculative.depth": 0})


def test_cli_set_flag(tmp_path, capsys):
    assert cli.main(["run", "-p", "smollm2", "hi", "--set", "speculative.method=ngram", "--set", "backend=llamacpp"]) == 2
    assert "needs backend 'torch'" in capsys.readouterr().err
    assert cli.main(["run", "-p", "smollm2", "hi", "--set", "nonsense"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_cli_broken_profile_exits_2_with_one_line(user_dir, capsys):
    write(user_dir, "broken", "model: m\nsampling: {max_tokens: many}\n")
    assert cli.main(["run", "-p", "broken", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sampling.max_tokens" in err and "Traceback" not in err


def test_cli_profiles_lists_good_and_broken(user_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no wrapped cells
    write(user_dir, "broken", "model: m\nbogus: 1\n")
    write(user_dir, "unclosed", "model: m\nstop: [a\n")
    write(user_dir, "beta", "extends: smollm2\ndescription: '[beta] [bold]my[/bold] test'\n")
    assert cli.main(["profiles", "--wide"]) == 0  # descriptions only with --wide
    out = capsys.readouterr().out
    assert "smollm2" in out and "broken" in out and "bogus" in out
    # brackets are text, not rich markup: neither dropped nor an error
    assert "[beta] [bold]my[/bold] test" in out and "expected ',' or ']'" in out


def test_llamaserver_profiles_speculate_with_what_llama_cpp_runs(user_dir):
    write(user_dir, "mod", "extends: smollm2-llamaserver\nspeculative: {method: ngram}\n"
                           "llama_server: {ngram_type: ngram-mod, spec_args: [--spec-ngram-mod-n-min, '2']}\n")
    ps = load_profiles()
    mod = ps.profiles["mod"]
    assert mod.method_label == "llama.cpp ngram-mod d=4"  # specchat's depth, passed on as llama.cpp's draft length
    assert ps.profiles["smollm2-llamaserver-ngram"].method_label == "llama.cpp ngram-simple d=3"
    reference = mod.target_only()
    assert reference.method == "none" and reference.llama_server.spec_args == []
    assert reference.llama_server.ngram_type == "ngram-mod"  # what else it runs stays


@pytest.mark.parametrize("text, message", [
    ("speculative: {method: suffix}", "llama-server runs method ngram, draft, mtp, eagle3, dflash, dspark, not 'suffix'"),
    ("speculative: {method: eagle3}", "method 'eagle3' needs `drafter`"),
    ("speculative: {method: dspark}", "method 'dspark' needs `drafter`"),
    ("speculative: {method: ngram}\nllama_server: {p_min: 0.5}", "llama_server.p_min stops a model drafter's draft"),
    ("speculative: {method: draft, drafter: d.gguf, lookup: 2}", "`lookup` and `suffix.first` are specchat's own loop"),
    ("llama_server: {spec_args: [--spec-type, ngram-mod]}", "spec_args add to a speculative method"),
    ("llama_server: {args: [--port, '9000']}", "--port: specchat sets these"),
    ("llama_server: {ngram_type: ngram-fancy}", "llama_server.ngram_type"),
    ("llama_server: {port: 70000}", "llama_server.port"),
])
def test_broken_llamaserver_profiles_are_one_line(user_dir, text, message):
    write(user_dir, "bad", f"extends: smollm2-llamaserver\n{text}\n")
    assert message in load_profiles().errors["bad"]


def test_llama_cpp_draft_types_are_llamaserver_methods(user_dir):
    write(user_dir, "e3", "extends: smollm2-llamaserver-eagle3\nllama_server: {p_min: 0.4}\n")
    write(user_dir, "ds", "extends: smollm2-llamaserver\nspeculative: {method: dspark, depth: 5, drafter: d.gguf}\n")
    (user_dir / "d.gguf").write_bytes(b"GGUF")
    write(user_dir, "native-ds", "extends: smollm2\nspeculative: {method: dspark, drafter: d.gguf}\n")
    ps = load_profiles()
    assert ps.profiles["e3"].method_label == "llama.cpp draft-eagle3 d=1"
    assert ps.profiles["smollm2-llamaserver-dflash"].method_label == "llama.cpp draft-dflash d=1"
    assert ps.profiles["ds"].method_label == "llama.cpp draft-dspark d=5"
    assert ps.profiles["e3"].target_only().server_config.p_min is None  # the reference drafts nothing
    # specchat's own engine runs DSpark too (a drafter directory; a GGUF file is refused when it loads)
    assert "native-ds" not in ps.errors and ps.profiles["native-ds"].speculative.method == "dspark"


def test_llama_server_section_is_only_for_its_backend(user_dir):
    write(user_dir, "bad", "extends: smollm2\nllama_server: {args: []}\n")
    assert "only for backend 'llamaserver'" in load_profiles().errors["bad"]


def test_the_default_is_the_fast_lossless_profile_and_smollm2_the_target_only_reference():
    ps = load_profiles()
    default, reference = ps.get(DEFAULT_PROFILE), ps.get("smollm2")
    assert default.compile and default.method == "ngram" and default.speculative.strict is not False
    assert default.model == reference.model and reference.method == "none" and not reference.compile


def test_suffix_profiles_validate_where_suffix_decoding_stands(user_dir):
    shipped = load_profiles().get("smollm2-suffix")
    assert shipped.method == "suffix" and shipped.speculative.suffix.history and shipped.speculative.suffix_drafts
    write(user_dir, "mine", "extends: smollm2-mtp\nspeculative:\n  suffix:\n    first: 5\n    history: false\n")
    mine = load_profiles().get("mine")
    assert mine.speculative.suffix_drafts and mine.method_label == f"mtp d={mine.speculative.depth} +suffix:5"
    write(user_dir, "alone", "extends: smollm2\nspeculative:\n  method: ngram\n  suffix:\n    first: 3\n")
    with pytest.raises(ProfileError, match=r"suffix.first.*model drafter.*method: suffix"):
        load_profiles().get("alone")
    write(user_dir, "both", "extends: smollm2-mtp-lookup\nspeculative:\n  suffix:\n    first: 3\n")
    with pytest.raises(ProfileError, match="either `lookup` or `suffix.first`"):
        load_profiles().get("both")
    write(user_dir, "typo", "extends: smollm2-suffix\nspeculative:\n  suffix:\n    min_prop: 0.2\n")
    with pytest.raises(ProfileError, match="speculative.suffix.min_prop: unknown key"):
        load_profiles().get("typo")


def test_suffix_settings_reach_the_engine_as_written(user_dir):
    from specchat.backends.speculative.suffix import SuffixSettings
    from specchat.loading import speculative_settings

    write(user_dir, "tuned", "extends: smollm2-suffix\nspeculative:\n  suffix:\n    min_prob: 0.3\n    factor: 2\n"
          "    max_match: 16\n    history_replies: 7\n    history_tokens: 900\n")
    s = speculative_settings(load_profiles().get("tuned"))
    assert s.method == "suffix" and s.suffix_first == 0
    assert s.suffix == SuffixSettings(min_prob=0.3, factor=2.0, max_match=16, memory=True, memory_replies=7,
                                      memory_tokens=900)


def test_a_profile_given_by_its_path_extends_like_one_in_the_folders(user_dir, tmp_path, capsys):
    """`-p path/to/x.yaml` with `extends:`: a shipped parent (its relative files still found), a
    user one, one beside the file; a missing parent or a cycle is one line, exit 2."""
    shipped = load_profiles().profiles["smollm2-mtp"]
    elsewhere = tmp_path / "elsewhere"
    mine = write(elsewhere, "mine", "extends: smollm2-mtp\nsampling: {temperature: 0.3}\n")
    got = load_profiles().get(str(mine))
    assert got.name == "mine" and got.model == shipped.model and got.sampling.temperature == 0.3
    assert got.resolve_path(got.speculative.drafter) == shipped.resolve_path(shipped.speculative.drafter)
    write(user_dir, "base", "extends: smollm2-fast\nsampling: {top_k: 7}\n")
    write(elsewhere, "sibling", "extends: base\nspeculative: {depth: 3}\n")
    child = write(elsewhere, "child", "extends: sibling\n")
    got = load_profiles().get(str(child))
    assert got.sampling.top_k == 7 and got.speculative.depth == 3 and got.method == shipped_method("smollm2-fast")
    write(elsewhere, "orphan", "extends: nowhere\n")
    write(elsewhere, "loop-a", "extends: loop-b\n")
    write(elsewhere, "loop-b", "extends: loop-a\n")
    for name, said in (("orphan", "extends: no profile named 'nowhere' to extend"), ("loop-a", "extends: cycle")):
        assert cli.main(["run", "-p", str(elsewhere / f"{name}.yaml"), "hi"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and said in err and "Traceback" not in err


def shipped_method(name: str) -> str:
    return load_profiles().profiles[name].method
