"""Detection data for prep: the seeded synthetic dataset (:mod:`prep.data.synth`) and COCO-format
loading, hold-out split and the letterboxed array cache (:mod:`prep.data.coco`)."""
