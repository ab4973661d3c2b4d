"""weight_broker"""
