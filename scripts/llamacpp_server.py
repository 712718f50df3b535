"""Serve a GGUF with llama-cpp-python's OpenAI-compatible server, the way specchat loads llama.cpp.

    python scripts/llamacpp_server.py [--model PATH] [--port 8000] [--api-key-env VAR]

Same as `python -m llama_cpp.server --model PATH --model_alias smollm2-135m-instruct`, except that
llama.cpp's extra CPU buffer types stay off where they crash on batched input (see
`backends.llamacpp.extra_buffers_work`); llama_cpp.server has no setting for that. Needs the server's
packages: `pip install fastapi uvicorn sse-starlette starlette-context pydantic-settings`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the default model, fetched with `specchat pull`)")
    ap.add_argument("--alias", default="smollm2-135m-instruct", help="the model name clients ask for")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="0: all physical cores")
    ap.add_argument("--api-key-env", help="require the key held in this environment variable")
    args = ap.parse_args(argv)

    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from specchat.backends.cpu import thread_count
    from specchat.backends.llamacpp import without_extra_buffers, extra_buffers_work
    from specchat import paths
    from specchat.models import pull

    model = Path(args.model) if args.model else pull(progress=False)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        print(f"llamacpp_server: ${args.api_key_env} is not set", file=sys.stderr)
        return 2
    threads = thread_count(args.threads)
    server = ServerSettings(host=args.host, port=args.port, api_key=api_key)
    settings = ModelSettings(model=str(model), model_alias=args.alias, n_ctx=args.n_ctx, n_threads=threads,
                             n_threads_batch=threads, verbose=False)
    with contextlib.nullcontext() if extra_buffers_work(model, paths.cache_dir()) else without_extra_buffers():
        app = create_app(server_settings=server, model_settings=[settings])  # loads the model now
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
