"""The OpenAI-compatible HTTP server: FastAPI on uvicorn, the engine on its own thread.

``create_app`` builds the app; ``app_from_args`` builds it from CLI flags; ``ServerThread`` runs
it in the background (``run``/``chat``, tests) and ``serve_foreground`` in the main thread
(``monobatch serve``). See docs/adr/0003-server.md.
"""

from monobatch.server.app import create_app
from monobatch.server.runner import ServerThread, app_from_args, bind, serve_foreground, settings_from_args
from monobatch.server.state import ServerSettings

__all__ = ["create_app", "app_from_args", "ServerThread", "ServerSettings", "bind", "serve_foreground",
           "settings_from_args"]
