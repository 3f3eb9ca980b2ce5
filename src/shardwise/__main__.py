from shardwise.cli import run

run()
