"""admin"""
