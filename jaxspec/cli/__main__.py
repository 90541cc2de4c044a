"""``python -m jaxspec.cli``: the ``jaxspec`` command."""

from jaxspec.cli import run

if __name__ == "__main__":  # importing the module (as the test set-up does) runs nothing
    run()
