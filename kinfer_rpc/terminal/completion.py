"""Shell completion for bash, zsh and fish, generated from the `kinfer` argument parser: the
commands, each command's options (their values where they are choices, files or models) and model
names where a command takes one. Model names come from `kinfer completion --models`, which reads
the stores without starting a server."""

from __future__ import annotations

import argparse
import shlex

import attrs

SHELLS = ("bash", "zsh", "fish")


@attrs.frozen
class Option:
    flags: tuple[str, ...]
    help: str
    value: str | None  # None: a flag; "file", "model", "option" (a request option's name), "choice", "word"
    choices: tuple[str, ...] = ()


@attrs.frozen
class Command:
    name: str
    help: str
    options: tuple[Option, ...]
    models: bool  # takes model names as its words (run, show, rm)
    words: tuple[str, ...] = ()  # the choices of its word (completion: the shells)


def _value(action: argparse.Action) -> str | None:
    if action.nargs == 0:
        return None
    if action.choices:
        return "choice"
    metavar = action.metavar if isinstance(action.metavar, str) else ""
    if action.dest in ("model", "models"):
        return "model"
    if action.dest == "options":
        return "option"
    if "FILE" in metavar:
        return "file"
    return "word"


def _options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    found = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        choices = tuple(str(c) for c in action.choices) if action.choices else ()
        found.append(Option(tuple(action.option_strings), _one_line(action.help), _value(action), choices))
    return tuple(found)


def _one_line(text: str | None) -> str:
    text = " ".join((text or "").split()).replace("%(default)s", "").replace("%%", "%")
    return text.split(" (")[0].split("; ")[0][:70]


def describe(parser: argparse.ArgumentParser) -> tuple[tuple[Option, ...], tuple[Command, ...]]:
    """The global options and the commands, read from the parser."""
    commands = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                positionals = [a for a in sub._actions if not a.option_strings]
                models = any(a.dest in ("model", "models") for a in positionals)
                words = tuple(str(c) for a in positionals for c in (a.choices or ()))
                commands.append(Command(name, _one_line(helps.get(name)), _options(sub), models, words))
    return _options(parser), tuple(commands)


def script(shell: str, parser: argparse.ArgumentParser, option_names: list[str]) -> str:
    """The completion script for `shell`."""
    top, commands = describe(parser)
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](top, commands, option_names)


# -- bash --------------------------------------------------------------------------------------
def _bash(top: tuple[Option, ...], commands: tuple[Command, ...], option_names: list[str]) -> str:
    def value_cases(options: tuple[Option, ...]) -> str:
        lines = []
        for o in options:
            if o.value is None:
                continue
            pattern = "|".join(o.flags)
            if o.value == "choice":
                lines.append(f"        {pattern}) _kinfer_words {shlex.quote(' '.join(o.choices))}; return ;;")
            elif o.value == "model":
                models = '"$(kinfer completion --models 2>/dev/null)"'
                lines.append(f"        {pattern}) _kinfer_words {models}; return ;;")
            elif o.value == "option":
                lines.append(f"        {pattern}) _kinfer_words {shlex.quote(' '.join(option_names))}; return ;;")
            elif o.value == "file":
                lines.append(f'        {pattern}) COMPREPLY=($(compgen -f -- "$cur")); return ;;')
            else:
                lines.append(f"        {pattern}) return ;;")
        return "\n".join(lines)

    cases = []
    for c in commands:
        flags = " ".join(f for o in c.options for f in o.flags)
        words = '"$(kinfer completion --models 2>/dev/null)"' if c.models else shlex.quote(" ".join(c.words))
        cases.append(
            f"    {c.name})\n"
            f"      case $prev in\n{value_cases(c.options)}\n      esac\n"
            f"      if [[ $cur == -* ]]; then _kinfer_words {shlex.quote(flags)}; else _kinfer_words {words}; fi ;;"
        )
    names = " ".join(c.name for c in commands)
    top_flags = " ".join(f for o in top for f in o.flags)
    return f"""# kinfer's completion for bash: `source <(kinfer completion bash)` in ~/.bashrc, or
# `kinfer completion bash > ~/.local/share/bash-completion/completions/kinfer`.
_kinfer_words() {{
  # the candidates that begin with the word being typed; bash splits words at ':' (qwen3:8b),
  # so what is offered is the part after the last ':' already typed
  local word
  COMPREPLY=()
  for word in $1; do
    [[ $word == "$cur"* ]] && COMPREPLY+=("${{word#"${{cur%"${{cur##*:}}"}}"}}")
  done
}}
_kinfer() {{
  # the words as typed, split at blanks only (COMP_WORDS splits at ':' too)
  local line=${{COMP_LINE:0:COMP_POINT}} cur prev command="" word
  local -a typed
  cur=${{line##*[[:space:]]}}
  read -ra typed <<< "${{line%"$cur"}}"
  prev=${{typed[${{#typed[@]}}-1]}}
  for word in "${{typed[@]:1}}"; do
    case $word in
      {"|".join(c.name for c in commands)}) command=$word; break ;;
    esac
  done
  case $command in
    "")
      case $prev in
{value_cases(top)}
      esac
      if [[ $cur == -* ]]; then _kinfer_words {shlex.quote(top_flags)}
      else _kinfer_words {shlex.quote(names)}; fi ;;
{chr(10).join(cases)}
  esac
}}
complete -o default -F _kinfer kinfer
"""


# -- zsh ---------------------------------------------------------------------------------------
def _zq(text: str) -> str:
    """Text inside a single-quoted _arguments spec: no brackets or colons, quotes escaped."""
    return text.replace("[", "(").replace("]", ")").replace(":", " -").replace("'", "'\\''")


def _zsh_spec(o: Option, option_names: list[str]) -> list[str]:
    action = {
        None: "",
        "choice": f":value:({' '.join(o.choices)})",
        "model": ":model:_kinfer_models",
        "option": f":option:({' '.join(option_names)})",
        "file": ":file:_files",
        "word": ":value: ",
    }[o.value]
    if o.value == "option":  # -o NAME VALUE
        action += ":value: "
    repeat = "*" if o.flags[0] in ("-o", "--tool") else ""  # repeatable: no exclusions
    exclusive = f"({' '.join(o.flags)})" if len(o.flags) > 1 and not repeat else ""
    return [f"'{repeat}{exclusive}{flag}[{_zq(o.help)}]{action}'" for flag in o.flags]


def _zsh(top: tuple[Option, ...], commands: tuple[Command, ...], option_names: list[str]) -> str:
    described = "\n".join(f"    '{c.name}:{_zq(c.help)}'" for c in commands)
    cases = []
    for c in commands:
        specs = [s for o in c.options for s in _zsh_spec(o, option_names)]
        if c.models:
            specs.append("'*:model:_kinfer_models'")
        if c.words:
            specs.append(f"'1:{c.name}:({' '.join(c.words)})'")
        body = " \\\n            ".join(specs)
        cases.append(f"        {c.name})\n          _arguments -s \\\n            {body} ;;")
    top_specs = " \\\n    ".join(s for o in top for s in _zsh_spec(o, option_names))
    return f"""#compdef kinfer
# kinfer's completion for zsh: `source <(kinfer completion zsh)` in ~/.zshrc (after compinit), or
# `kinfer completion zsh > "${{fpath[1]}}/_kinfer"`.
_kinfer_models() {{
  local -a models
  models=(${{(f)"$(kinfer completion --models 2>/dev/null)"}})
  compadd -a models
}}
_kinfer() {{
  local curcontext=$curcontext state line
  local -a commands
  commands=(
{described}
  )
  _arguments -C \\
    {top_specs} \\
    '1:command:->command' \\
    '*::argument:->argument'
  case $state in
    command) _describe command commands ;;
    argument)
      case $words[1] in
{chr(10).join(cases)}
      esac ;;
  esac
}}
if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
  _kinfer "$@"
else
  compdef _kinfer kinfer
fi
"""


# -- fish --------------------------------------------------------------------------------------
def _fq(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_line(condition: str, o: Option, option_names: list[str]) -> str:
    parts = ["complete -c kinfer", f"-n {_fq(condition)}"]
    for flag in o.flags:
        if flag.startswith("--"):
            parts.append(f"-l {flag[2:]}")
        elif len(flag) == 2:
            parts.append(f"-s {flag[1:]}")
        else:
            parts.append(f"-o {flag[1:]}")
    if o.value == "file":
        parts.append("-r -F")
    elif o.value == "model":
        parts.append("-x -a '(kinfer completion --models 2>/dev/null)'")
    elif o.value == "choice":
        parts.append(f"-x -a {_fq(' '.join(o.choices))}")
    elif o.value == "option":
        parts.append(f"-x -a {_fq(' '.join(option_names))}")
    elif o.value == "word":
        parts.append("-x")
    parts.append(f"-d {_fq(o.help)}")
    return " ".join(parts)


def _fish(top: tuple[Option, ...], commands: tuple[Command, ...], option_names: list[str]) -> str:
    lines = [
        "# kinfer's completion for fish: `kinfer completion fish > ~/.config/fish/completions/kinfer.fish`",
        "complete -c kinfer -f",
    ]
    lines += [_fish_line("__fish_use_subcommand", o, option_names) for o in top]
    for c in commands:
        lines.append(f"complete -c kinfer -n __fish_use_subcommand -a {c.name} -d {_fq(c.help)}")
        seen = f"__fish_seen_subcommand_from {c.name}"
        lines += [_fish_line(seen, o, option_names) for o in c.options]
        if c.models:
            lines.append(f"complete -c kinfer -n {_fq(seen)} -a '(kinfer completion --models 2>/dev/null)'")
        if c.words:
            lines.append(f"complete -c kinfer -n {_fq(seen)} -a {_fq(' '.join(c.words))}")
    return "\n".join(lines) + "\n"
