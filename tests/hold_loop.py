"""kinfer-rpc whose `model/list` holds its event loop: the handler blocks the loop's thread for two
minutes. For the tests of what must still end a server whose loop is held (the watchdog): no
request of the product itself holds the loop that long any more (what could, an LSP didChange of
many edits, now runs on a worker thread), so this script stands in for the next bug that would.

    python tests/hold_loop.py [kinfer-rpc's arguments]
"""

import sys
import time

from kinfer_rpc.protocol import handlers


async def _held(self, ctx, /, **params):
    time.sleep(120)  # on the loop's thread: nothing else of the server runs meanwhile
    return {"models": []}


handlers.Handlers.model_list = _held

if __name__ == "__main__":
    from kinfer_rpc.protocol.server import main

    main(sys.argv[1:])
