"""Full-model pipeline training: a node's S placement-group bundles each hold one DeepSpeed pipeline stage."""
