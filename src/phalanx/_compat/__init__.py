"""The one boundary to other libraries' private APIs (torch, Keras, CPython).

Every use of a foreign ``_`` member lives in :mod:`phalanx._compat.torch` or
:mod:`phalanx._compat.keras`, each shim with the versions it was checked on and a test
(``tests/test_compat.py``), so that a torch or Keras upgrade touches only these files.
``tests/test_architecture.py`` fails on a private member read anywhere else.
"""
