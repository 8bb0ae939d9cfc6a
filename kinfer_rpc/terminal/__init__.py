"""What the `kinfer` command needs to read well at a terminal and to forgive a person's slips:
word wrap for streamed replies, tables that fit the window, request options by any spelling,
did-you-mean and the next step after an error, the config file, saved conversations and shell
completion. Nothing here speaks the protocol; kinfer_rpc/cli.py does."""
