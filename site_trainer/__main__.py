"""`torchrun ... -m site_trainer --config trainer.json`: start one rank of a site trainer service."""

from site_trainer.service import main

main()
