"""``python -m keras_sync``: the ``keras-sync`` command line, for a shell that has no script of it on its PATH."""

from keras_sync.cli import cli

if __name__ == "__main__":
    cli.main(prog_name="python -m keras_sync")
