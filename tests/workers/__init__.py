"""Scripts the tests run by path, as their own processes (a kill mid-run, torchrun ranks). Their folder goes
first on sys.path, so it holds no packages: beside tests/kernels, an ``import kernels`` in transformers found
the test folder instead of Hugging Face's kernels."""
