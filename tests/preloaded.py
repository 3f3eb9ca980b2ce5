"""Imported once by the tests' forkserver (`spawn.py`): every name `import shardwise` offers (the
package imports them on first use), so no rank imports them again."""

import shardwise

shardwise.preload()
