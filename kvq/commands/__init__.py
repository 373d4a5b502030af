"""The `kvq` subcommands: each module parses its flags, calls the library and renders the result."""
