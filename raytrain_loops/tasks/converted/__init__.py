"""The built-in tasks' variants on data converted by ``raytrain-loops convert`` that their own
modules have no room for; each is made by its task's ``task.params.data``."""
