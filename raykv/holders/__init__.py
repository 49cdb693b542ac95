"""holders"""
