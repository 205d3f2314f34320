"""``python -m keras_sync.launch``: the ``keras-sync launch`` command line."""

from keras_sync.cli.launch import command

if __name__ == "__main__":
    command.main(prog_name="python -m keras_sync.launch")  # exits with the command's code
