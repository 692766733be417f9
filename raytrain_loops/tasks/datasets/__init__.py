"""The data sets the built-in tasks generate, so that every recipe runs with no download: the
images of ``patterns`` (``images_cls``), the ``shapes`` of ``detr`` and ``seamseg``, the token
streams of ``lm``."""
