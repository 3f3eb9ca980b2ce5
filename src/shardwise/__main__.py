from shardwise.entry import main

main()
