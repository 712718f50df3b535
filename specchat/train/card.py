"""What every trainer writes beside its drafter: where the data came from, and the one shell
command that makes the drafter again from scratch (data first, then training)."""
from __future__ import annotations

import json
from pathlib import Path

from specchat.train import generator_dtype
from specchat.train.self_prompts import remake_command
from specchat.train.store import INFO


def prompt_sources(data_info: dict) -> str:
    """The card's account of where the training prompts came from."""
    names = data_info.get("prompt_files", [])
    if not names:
        return "?"
    notes = ["self-instruct, Apache-2.0" if n.startswith("self-instruct") else f"{n}: see its data directory"
             for n in names]
    return ", ".join(names) + " (" + "; ".join(dict.fromkeys(notes)) + ")"


def data_info_of(dirs: list[Path]) -> dict:
    """The first directory's settings, with the prompt files of all of them."""
    infos = [json.loads((d / INFO).read_text()) for d in dirs if (d / INFO).exists()]
    if not infos:
        return {}
    files = list(dict.fromkeys(Path(f).name for i in infos for f in i.get("prompt_files", [])))
    return infos[0] | {"prompt_files": files}


def data_commands(profile, data: list[Path]) -> list[str]:
    """The commands that make each data directory again, from its info.json (a directory without
    one is left out): `specchat train unpack` where it came from the corpus in the repository (its
    replies are kept there; minutes, not hours), `specchat train tasks` where the target wrote its
    own material, else `specchat train data`, after the `specchat train prompts` command of any
    prompt file the target wrote itself."""
    commands = []
    for d in data:
        if not (d / INFO).exists():
            continue
        info = json.loads((d / INFO).read_text())
        if info.get("unpacked_from"):
            commands.append(f"specchat train unpack --target {info.get('target', profile.name)} "
                            f"--corpus {info['unpacked_from']} --out {d} --top-k {info['top_k']}")
            continue
        if info.get("kind"):  # written by `specchat train tasks`
            from specchat.train.tasks import remake_command as tasks_command

            commands.append(tasks_command(info, d))
            continue
        for f in info["prompt_files"]:  # prompts the target wrote itself come first
            prompts = remake_command(Path(f))
            if prompts and prompts not in commands:
                commands.append(prompts)
        gen = (f"specchat train data --target {info.get('target', profile.name)} --prompts "
               f"{' '.join(info['prompt_files'])} --out {d} --max-tokens {info['max_tokens']} --top-k {info['top_k']}")
        if info.get("temperature"):
            gen += f" --temperature {info['temperature']} --seed {info['seed']}"
        for flag in ("instances", "variants"):
            gen += f" --{flag}" if info.get(flag) else ""
        if info.get("limit"):
            gen += f" --limit {info['limit']}"
        generator = str(info.get("generator", ""))
        if generator.startswith("transformers"):  # "transformers DTYPE, batched"
            gen += f" --batch {info.get('batch') or 48} --dtype {generator_dtype(generator)}"
        commands.append(gen)
    return commands


def full_command(profile, data: list[Path], train: str) -> str:
    """The data commands, then `train` (the trainer's own command line), as one shell command."""
    return " && \\\n  ".join(data_commands(profile, data) + [train])
