"""Test stand-in for the ``horovod`` package name (``import horovod`` in Horovod's
pytorch_mnist.py, only for ``horovod.run``); see tests/horovod_examples/README.md."""


def run(*args, **kwargs):
    raise NotImplementedError("horovod.run is not provided by commlib.horovod: launch with "
                              "`mpiexec -n N python script.py` or `commlib-horovodrun`")
