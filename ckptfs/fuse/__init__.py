"""fuse"""
