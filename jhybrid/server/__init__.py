"""OpenAI-compatible HTTP server over the engine: `jhybrid serve --model DIR`.

    engine = build_engine("path/to/ckpt", max_num_seqs=32)       # an AsyncEngine (engine thread)
    app = create_app(engine, ServerConfig(model_names=("tiny",), chat_template=load_chat_template("path/to/ckpt")))
    serve("path/to/ckpt", host="127.0.0.1", port=8000)           # all of the above, then uvicorn; returns the exit status
"""

from jhybrid.server.app import ServerConfig, create_app
from jhybrid.server.async_engine import AsyncEngine, Delta, EngineDeadError, EngineDrainingError, EngineOverloadedError
from jhybrid.server.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from jhybrid.server.launch import BackgroundServer, GracefulServer, build_engine, is_loopback, serve
from jhybrid.server.metrics import EngineMetrics

__all__ = ["AsyncEngine", "BackgroundServer", "ChatTemplate", "ChatTemplateError", "Delta", "EngineDeadError",
           "EngineDrainingError", "EngineMetrics", "EngineOverloadedError", "GracefulServer", "ServerConfig", "build_engine",
           "create_app", "is_loopback", "load_chat_template", "serve"]
