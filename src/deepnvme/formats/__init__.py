"""Pure file formats: where bytes live in torch.save zip files and safetensors files.
Nothing here moves tensor bytes or opens handles."""
