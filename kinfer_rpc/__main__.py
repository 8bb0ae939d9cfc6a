from kinfer_rpc.protocol.server import main

main()
