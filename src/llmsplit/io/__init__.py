"""Reading and writing the outside world's formats: tokenizers, token files, run folders."""
