"""A stand-in for nanoGPT's configurator.py (exec'd by train.py): each argument is a config file
to exec, or `--key=value` overriding a global of the same type (`ast.literal_eval`, else str)."""

if __name__ == "__main__":  # exec'd inside train.py's __main__; inert when imported
    import sys
    from ast import literal_eval

    for arg in sys.argv[1:]:
        if "=" not in arg:
            assert not arg.startswith("--"), arg
            with open(arg) as f:
                exec(f.read())
            continue
        key, val = arg[2:].split("=", 1)
        if key not in globals():
            raise ValueError(f"Unknown config key: {key}")
        try:
            attempt = literal_eval(val)
        except (SyntaxError, ValueError):
            attempt = val
        assert type(attempt) is type(globals()[key]), f"{key}: {attempt!r}"
        print(f"Overriding: {key} = {attempt}")
        globals()[key] = attempt
