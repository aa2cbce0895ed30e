"""The Fabric adapter's guards: the strategies it is proved on and the misuse it refuses."""
