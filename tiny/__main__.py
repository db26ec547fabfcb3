"""`python -m tiny [--config FILE] [--set KEY=VALUE ...]` (`make tiny-model`): builds the config's tiny model and
prints its folder, which a fleet's config names (`model.name_or_path`) to serve it."""

from tiny.build import main

main()
