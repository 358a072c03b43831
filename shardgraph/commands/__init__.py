"""The command glue that sits above the layers: it reads pipeline files (``train.config``) and
calls a library below (the planner), which itself reads no file and imports no command."""
